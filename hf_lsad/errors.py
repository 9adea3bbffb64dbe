"""The exceptions hf-lsad raises on purpose, exported from :mod:`hf_lsad`.

All are ``ValueError`` subclasses, so code that caught ``ValueError`` before keeps working.

- :class:`GuardFormatError`: a saved guard, SAE or activation store is missing, malformed
  or does not fit (a wrong type, an out-of-range value, an unknown key, a missing tensor).
- :class:`GuardMismatchError`: a guard's files are well-formed but are not the ones it was
  saved with: a tensor file whose SHA-256 differs from the one recorded in its
  ``config.json``, or settings (method, score metric, mask, SAE, position, ...) that differ
  from the ones its threshold was set for.
- :class:`UnsafeGuardFileError`: a guard folder holds something hf-lsad never reads on
  principle: pickle files (which can run code when loaded) or links that resolve outside
  the folder.
- :class:`ModelMismatchError`: the model to guard is not one the guard can read (hidden
  size, layer count, hooked block or base model differ).
- :class:`InputError`: inputs to guarded ``generate`` the guard cannot score meaningfully
  (e.g. a prompt longer than the model's context).
- :class:`MissingColumnError`: a table of prompts without the prompt or id column asked for.

And six warning categories: :class:`DegenerateFitWarning`, for fits that finish but should not be trusted (an SAE
that explains little variance, clusters too small for their masks or covariances); filter it to an error with
``warnings.simplefilter("error", DegenerateFitWarning)``. :class:`SmallSampleWarning`, for a guard taught a sample of
the user's traffic too small for the guard to be steady (``teach``: fewer than a thousand prompts).
:class:`ReteachWarning`, for a head taught the user's traffic and taught again, which keeps only what the new sample
holds. :class:`ThresholdsResetWarning`, for a head added to a guard whose thresholds were set on the user's traffic,
which sets them again on the bundled chat, and for the thresholds of a taught guard set again by ``set-budget``.
:class:`AdapterWarning` and :class:`ScoreShiftWarning`, for a model guarded, as the user allowed, although it runs
other peft adapters, or scores the guard's probe prompts otherwise, than the model the guard's thresholds were set
through.
"""

from __future__ import annotations

import sys
import warnings


class GuardFormatError(ValueError):
    """A saved SAE, detector or guard is missing, corrupt or does not fit."""


class GuardMismatchError(GuardFormatError):
    """A guard's tensors or settings differ from the ones recorded when it was saved."""


class UnsafeGuardFileError(GuardFormatError):
    """A guard folder holds pickle files or links that leave the folder; nothing is loaded."""


class ModelMismatchError(ValueError):
    """The model cannot be read at the guard's hook point, or is not the guard's base model."""


class InputError(ValueError):
    """Inputs to guarded generation that the guard cannot score meaningfully."""


class MissingColumnError(ValueError):
    """A table of prompts without the column asked for (its first readable row lacks it); ``columns`` are those it
    has. Each command adds its own remedy (``--column`` for ``screen``)."""

    def __init__(self, message: str, column: str, columns: list[str]) -> None:
        super().__init__(message)
        self.column, self.columns = column, columns


class DegenerateFitWarning(UserWarning):
    """A fit finished, but its result is degenerate (the message gives the number and the floor)."""


class SmallSampleWarning(UserWarning):
    """A guard was taught a sample of the user's traffic so small that another sample of the same traffic would
    give another guard (the message gives the count and what to bring)."""


class ThresholdsResetWarning(UserWarning):
    """A head was added to a guard whose thresholds had been set on other rows than the bundled validation chat (a
    user's own traffic): every threshold is set again on that chat, and the message says how to set them on the
    traffic again. Also: the thresholds of a guard taught the user's traffic are set again (``set-budget``), on rows
    that may be the ones it was taught or that are not that traffic."""


class ReteachWarning(UserWarning):
    """A supervised head taught a user's traffic is taught again: it is fitted on the bundled rows and the new sample
    alone, so it keeps what it learnt of the earlier traffic only if the new sample holds that traffic too."""


class AdapterWarning(UserWarning):
    """A guarded model runs other peft adapters than the guard's thresholds were set through
    (:func:`hf_lsad.capture.adapters.check_adapter`)."""


class ScoreShiftWarning(UserWarning):
    """A guarded model scores the guard's probe prompts otherwise than the model its thresholds were set through
    (:func:`hf_lsad.guard.fingerprint.check_fingerprint`)."""


_PASSED_THROUGH = ("hf_lsad", "torch", "transformers")
"""Packages whose frames lie between a user's call and a warning raised for it (``no_grad`` wrappers, ``generate``
calling a logits processor, ``nn.Module.__call__``)."""


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's own line: the first frame outside hf-lsad, torch and transformers,
    whatever path led here (as pandas' ``find_stack_level``). A fixed ``stacklevel`` is right for one path only; on
    the others it pointed into the package or into torch's ``no_grad`` wrapper."""
    frame, level = sys._getframe(1), 2  # the caller of warn is warnings.warn's stacklevel 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _PASSED_THROUGH:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


__all__ = [
    "AdapterWarning",
    "DegenerateFitWarning",
    "GuardFormatError",
    "GuardMismatchError",
    "InputError",
    "MissingColumnError",
    "ModelMismatchError",
    "ReteachWarning",
    "ScoreShiftWarning",
    "SmallSampleWarning",
    "ThresholdsResetWarning",
    "UnsafeGuardFileError",
]
