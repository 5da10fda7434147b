"""The one place that decides what of a store URL may be shown (CLI, logs, errors, HTTP).

The rule is positional, so a typing mistake cannot defeat it: everything between the
scheme's ``//`` and the **last** ``@`` of the URL is credentials, whatever characters it
holds (an unencoded ``/``, ``@``, ``:``, ``?`` or ``%`` in a password included), and is never
shown. Only a plain user name (letters, digits, ``. _ ~ -``) followed by ``:`` survives:
``postgresql://app:***@db:5432/jobs``. Query options whose name looks like a credential
(``password``, ``passwd``, ``sslpassword``, ``token``, ``secret``, ...) show ``***`` as their
value, and a port that is not a number (a password typed without its ``@``) shows ``***``.

The price of the rule: an ``@`` meant in a path or an option value must be written ``%40``.

In free text (:func:`scrub`), every ``://`` that follows a scheme character starts a URL, which
runs to the next whitespace or quote and is masked by the same rule. Every pattern here runs
in linear time (issue 25: a quadratic one let one request cost seconds of CPU), and Python
code runs only for a URL that holds something to mask (or is of a rare shape: an inner
``://``, a ``%`` in an option's name): one compiled pattern, found from the literal ``://``,
passes over every other URL (the common case) and takes the common shapes of credentials,
ports and options apart itself; :func:`mask_url` decides for everything else.

:func:`for_terminal` is the one sanitiser of untrusted text shown in a terminal: masked, and
control and bidi characters shown escaped.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, unquote_plus

__all__ = [
    "BIDI_CONTROLS",
    "CUT_NOTE",
    "MASK",
    "MAX_MASKED",
    "UrlParts",
    "cut_text",
    "escape_controls",
    "escape_json",
    "escape_line",
    "for_terminal",
    "invisible_char",
    "is_secret_option",
    "mask_hosts",
    "mask_text",
    "mask_url",
    "one_line",
    "scrub",
    "secret_option_cut",
    "split_url",
    "url_secrets",
]

MASK = "***"
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)(://|:)")
_PLAIN_USER_RE = re.compile(r"[A-Za-z0-9._~-]+")
_SECRET_WORDS = "pass|pwd|token|secret|credential|api_?key"
_SECRET_OPTION_RE = re.compile(_SECRET_WORDS, re.IGNORECASE)
_KEYWORD = f"(?i:{_SECRET_WORDS})"
# A query pair whose name may be a credential's (a credential word, or a '%' to decode): only
# those are looked at by Python code.
_MAYBE_SECRET_PAIR_RE = re.compile(rf"(?<![^&;?#])(?=[^&;?#=]*?(?:%|{_KEYWORD}))([^&;?#=]*)=[^&;?#]*")
# Separators of query pairs; '?' and '#' too, so a stray second '?' cannot hide a secret.
_QUERY_SEP_RE = re.compile(r"([&;?#])")
# Credentials that hold a query with a credential-like option: an unencoded '@' in that
# option's value moved the cut, and the "host" after it is a piece of the secret.
# The keyword is looked for by a lazy lookahead and the name consumed possessively: the
# former pattern's two greedy runs around the keyword backtracked quadratically.
_OPTION_IN_USERINFO_RE = re.compile(rf"[?&;](?=[^=&;?#]*?(?:{_SECRET_WORDS}))[^=&;?#]*+=", re.IGNORECASE)

# -- the pattern of scrub(): a URL in free text with something to mask ----------------------
# Every repeat is possessive (nothing consumed is tried again) but the lazy look for a
# credential word, which the end of one name bounds: linear by construction. It is found from
# its literal '://' (a fast scan), and a URL with nothing to mask is never matched:
# its check (_HARMLESS) may not run over an inner '://', so a URL holding one is matched and
# consumed whole, and the search never starts again inside a URL it has passed over. Optional
# parts are written as branches ``(?:x|)`` and a repeat is entered only after a lookahead saw
# its first character: both spare the engine the set-up of a repeat (most of its cost here).
_END = r"""(?=[\s'"]|\Z)"""


def _run(excluded: str) -> str:
    """A run of characters but ``excluded``, whitespace, quotes and '@', never holding '://'."""
    chars = rf"""[^:{excluded}\s'"@]*+"""
    return rf"""{chars}(?:(?=:)(?::(?!//){chars})*+|)"""


# A host of the list (an IPv6 literal, a name) and a port that is a number, empty or masked.
_PIECE = r"""(?:\[[0-9A-Fa-f:.]*+\]|)[^,/?\s'"@\[\]:]*+(?::(?:[0-9]++|\*\*\*|(?!//))|)"""
# A query pair with no '=', or whose name (no '%' to decode, no ':') holds no credential word.
_PAIR = (rf"""(?:[^:=&;?#\s'"@]*+(?![=:])|(?![^:=&;?#%\s'"@]*?{_KEYWORD})[^:=&;?#%\s'"@]*+="""
         rf"""{_run("&;?#")})""")
_PAIRS_ON = rf"""(?:(?=[&;?#])(?:[&;?#]{_PAIR})*+|){_END}"""
_HOSTS = rf"""{_PIECE}(?:(?=,)(?:,{_PIECE})*+|)"""
_PATH = rf"""(?:/{_run("?")}|)"""
_PATH_QUERY = rf"""{_PATH}(?:\?{_PAIR}{_PAIRS_ON}|{_END})"""
_HOSTS_ON = _HOSTS + _PATH_QUERY
_HARMLESS = rf"""(?:\*\*\*@|[A-Za-z0-9._~-]++:\*\*\*@|){_HOSTS_ON}"""
_MASKABLE_RE = re.compile(
    rf"""://(?<=[A-Za-z0-9+.-]://)(?!{_HARMLESS})(?:"""
    # credentials (no '?&;' in them: see _OPTION_IN_USERINFO_RE), then nothing else to mask
    rf"""(?:(?P<user>[A-Za-z0-9._~-]++):|)[^\s'"@?&;]*+@(?P<after_at>{_HOSTS_ON})"""
    # one host (no ']': its port starts at the first ':') whose port is not a number, then
    # nothing else to mask (an empty port is harmless: it failed _HARMLESS by a '//' after it)
    rf"""|(?P<host>[^,/?\s'"@\[\]:]*+):[^,/?\s'"@\]]++(?P<after_port>{_PATH_QUERY})"""
    # one credential-like option (its name with no '%' to decode), then nothing else to mask
    rf"""|(?P<before_value>{_HOSTS}{_PATH}\?(?:{_PAIR}[&;?#])*+[^:=&;?#%\s'"@]*?{_KEYWORD}"""
    rf"""[^:=&;?#%\s'"@]*+=){_run("&;?#")}(?P<after_value>{_PAIRS_ON})"""
    r"""|(?P<url>[^\s'"]*+))"""  # anything else: mask_url's own code
)

BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Characters that reorder the text around them (an id could read as another)."""
# Format characters (Unicode category Cf) and default-ignorable code points, as ranges of a
# character class: invisible, or changing how their neighbours show (zero-width spaces and
# joiners, the soft hyphen, the BOM, variation selectors, tags, the bidi controls). A test
# checks the list against unicodedata's Cf category.
_INVISIBLE = ("\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u115f\u1160"
              "\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164"
              "\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
              "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff")
_INVISIBLE_RE = re.compile(f"[{_INVISIBLE}\u2028\u2029]")
# C0 controls but the newline, DEL, C1 controls (0x9b is a CSI on some terminals), the line
# and paragraph separators, the bidi controls and every other format or default-ignorable
# character.
_UNSAFE_RE = re.compile(f"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029{_INVISIBLE}]")
# The same and the newline: text that must stay on one line (a log record).
_LINE_UNSAFE_RE = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{_INVISIBLE}]")

CUT_NOTE = "… cut, {size} bytes"
"""What :func:`cut_text` puts after the part of a text it keeps (``size``: the whole text's)."""
MAX_MASKED = 64 * 1024
"""The longest text (UTF-8 bytes) :func:`scrub` masks whole: a longer one is cut first
(:func:`cut_text`), so masking one value costs a bounded time, whatever its size."""
# What a cut keeps: masking lengthens a text by at most half ("a://@ " -> "a://***@ ") and
# must leave it under the cap (a fixed point).
_MASKED_KEEP = 40 * 1024
ONE_LINE = 120
"""Characters of a long text a list shows (:func:`one_line`)."""


def invisible_char(text: str) -> str | None:
    """The first format, default-ignorable or line-separator character of ``text``, or None."""
    found = _INVISIBLE_RE.search(text)
    return None if found is None else found.group(0)


def cut_text(text: str, limit: int, keep: int | None = None) -> str:
    """``text`` if its UTF-8 form fits in ``limit`` bytes, else its first bytes (``keep``, by
    default as many as leave room for the note within ``limit``), never splitting a
    character, followed by ``… cut, N bytes`` (N: the whole text's size)."""
    if len(text) * 4 <= limit:
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    note = CUT_NOTE.format(size=len(data))
    room = max(0, limit - len(note.encode()) if keep is None else min(keep, limit))
    return data[:room].decode("utf-8", "ignore") + note


def one_line(text: str, width: int = ONE_LINE) -> str:
    """The first line of ``text`` (stripped), cut to ``width`` characters with ``…``: what a
    list shows of a long text (an error), the whole of it being on its own page."""
    head = text[: width * 4 + 2].strip()
    first = head.split("\n", 1)[0].rstrip("\r")
    more = len(first) > width or "\n" in head or len(text.strip()) > len(head)
    if not more:
        return first
    return first[: width - 1].rstrip() + "…"


@dataclass(frozen=True)
class UrlParts:
    """A URL cut where the masking rule cuts it; nothing is validated or decoded."""

    scheme: str
    """The scheme as typed ("" when the text does not start with one)."""
    separator: str
    """``://``, or ``:`` when the slashes are missing, or ""."""
    userinfo: str | None
    """Everything before the last ``@`` (without it); None when there is no ``@``."""
    authority: str
    """The host list: after the userinfo, up to the first ``/`` or ``?``."""
    path: str
    """From the ``/`` after the host list up to the ``?``."""
    query: str | None
    """After the first ``?`` that follows the userinfo; None when there is none."""


def split_url(url: str) -> UrlParts:
    """Cut ``url`` into scheme, credentials, hosts, path and query by the masking rule."""
    match = _SCHEME_RE.match(url)
    if match:
        return _split_rest(match.group(1), match.group(2), url[match.end():])
    return _split_rest("", "", url)


def _split_rest(scheme: str, separator: str, rest: str) -> UrlParts:
    userinfo: str | None = None
    at = rest.rfind("@")
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1:]
    query: str | None = None
    end = _first_of(rest, "/?")
    authority, rest = rest[:end], rest[end:]
    if "?" in rest:
        rest, query = rest.split("?", 1)
    return UrlParts(scheme, separator, userinfo, authority, rest, query)


def _first_of(text: str, chars: str) -> int:
    found = [i for i in (text.find(c) for c in chars) if i >= 0]
    return min(found) if found else len(text)


def secret_option_cut(parts: UrlParts) -> bool:
    """Whether the last ``@`` fell inside a credential-like option's value (nothing is safe)."""
    return parts.userinfo is not None and _OPTION_IN_USERINFO_RE.search(parts.userinfo) is not None


def is_secret_option(name: str) -> bool:
    """Whether a query option's value is a credential (``password``, ``sslpassword``, ``token``...)."""
    return _SECRET_OPTION_RE.search(unquote_plus(name)) is not None


def mask_url(url: object, *, brief: bool = False) -> str:
    """``url`` with its credentials replaced by ``***`` (see the module's rule).

    ``brief`` keeps the scheme, the hosts and the path (the database, file or namespace)
    only, as ``/info`` shows a store. Works on any text, well-formed or not, and on its own
    output (masking twice changes nothing).
    """
    parts = split_url(url if isinstance(url, str) else str(url))
    return f"{parts.scheme}{parts.separator}{_mask_rest(parts, brief)}"


def _mask_rest(parts: UrlParts, brief: bool = False) -> str:
    """What :func:`mask_url` shows after the scheme and its separator."""
    if secret_option_cut(parts):
        return MASK
    hosts = mask_hosts(parts.authority)
    if brief:
        return f"{hosts}{parts.path}"
    query = "" if parts.query is None else "?" + _mask_query(parts.query)
    return f"{_mask_userinfo(parts.userinfo)}{hosts}{parts.path}{query}"


def _mask_userinfo(userinfo: str | None) -> str:
    if userinfo is None:
        return ""
    user, colon, _ = userinfo.partition(":")
    if colon and _PLAIN_USER_RE.fullmatch(user):
        return f"{user}:{MASK}@"
    return f"{MASK}@"


def mask_hosts(authority: str) -> str:
    """A host list with every port that is not a number (a mistyped credential) as ``***``."""
    return ",".join(_mask_port(piece) for piece in authority.split(","))


def _mask_port(piece: str) -> str:
    bracket = piece.rfind("]")
    colon = piece.find(":", bracket + 1)
    if colon < 0:
        return piece
    port = piece[colon + 1:]
    if port == "" or (port.isascii() and port.isdigit()) or port == MASK:
        return piece
    return f"{piece[:colon]}:{MASK}"


def _mask_query(query: str) -> str:
    return _MAYBE_SECRET_PAIR_RE.sub(_mask_pair, query)


def _mask_pair(match: re.Match[str]) -> str:
    name = match.group(1)
    return f"{name}={MASK}" if is_secret_option(name) else match.group(0)


@functools.lru_cache(maxsize=64)
def _cached_secrets(url: str) -> tuple[str, ...]:
    return tuple(url_secrets(url))


def url_secrets(url: str | None) -> list[str]:
    """Every text of ``url`` that must never be shown, raw and percent-decoded, longest first."""
    if not url:
        return []
    parts = split_url(url)
    found: set[str] = set()
    if secret_option_cut(parts):
        rest = url[len(parts.scheme) + len(parts.separator):]
        match = _OPTION_IN_USERINFO_RE.search(rest)
        value = rest[match.end():] if match else rest
        found.update((rest, value, _QUERY_SEP_RE.split(value)[0]))
    if parts.userinfo is not None:
        user, colon, password = parts.userinfo.partition(":")
        if colon:
            found.add(password)
        if not (_PLAIN_USER_RE.fullmatch(user) and (colon or not password)):
            found.add(parts.userinfo)
    found.update(_odd_ports(parts.authority))
    for pair in _QUERY_SEP_RE.split(parts.query or "")[::2]:
        name, equals, value = pair.partition("=")
        if equals and is_secret_option(name):
            found.add(value)
    decoded = {unquote(s) for s in found} | {unquote_plus(s) for s in found}
    spellings = found | decoded | {quote(s, safe="") for s in decoded}
    spellings.discard("")
    # Longest first, so a secret containing another never leaves a piece behind.
    return sorted(spellings, key=len, reverse=True)


def _odd_ports(authority: str) -> list[str]:
    """The ports of ``authority`` that :func:`mask_hosts` hides."""
    odd = []
    for piece in authority.split(","):
        masked = _mask_port(piece)
        if masked != piece:
            odd.append(piece[len(masked) - len(MASK):])
    return odd


def scrub(text: str, url: str | None = None) -> str:
    """``text`` with ``url`` shown masked, every secret of ``url`` and every URL in it masked.

    For messages metafora does not compose itself (driver errors) and for anything the CLI
    prints: the URL's own occurrences are masked first, so the rest of the text is not
    mangled by the replacement of a secret that happens to be short. A text over
    :data:`MAX_MASKED` bytes is cut first (:func:`cut_text`): one value never costs more
    than a bounded time, whatever its size, and the result is still a fixed point.
    """
    if len(text) > MAX_MASKED // 4:
        text = cut_text(text, MAX_MASKED, _MASKED_KEEP)
    return mask_text(text, url)


def mask_text(text: str, url: str | None = None) -> str:
    """:func:`scrub` without its cap: the whole of ``text`` masked, in time linear in its size."""
    if url:
        text = text.replace(url, mask_url(url))
        for secret in _cached_secrets(url):
            text = text.replace(secret, MASK)
    # Any other URL in the text (a driver's own message) is masked by the same rule.
    return _MASKABLE_RE.sub(_mask_match, text)


def _mask_match(match: re.Match[str]) -> str:
    user, after_at, host, after_port, before_value, after_value, url = match.groups()
    if after_at is not None:  # the credentials are all there is to mask
        return f"://{MASK}@{after_at}" if user is None else f"://{user}:{MASK}@{after_at}"
    if after_port is not None:
        return f"://{host}:{MASK}{after_port}"
    if after_value is not None:
        return f"://{before_value}{MASK}{after_value}"
    return "://" + _mask_rest(_split_rest("", "://", url))


def escape_controls(text: str) -> str:
    """``text`` with control, line-separator, bidi and other format characters written as
    escapes.

    ``\\x1b`` for a character below 256, ``\\u202e`` above (``\\U000e0041`` beyond); the
    newline is kept. For ids, which are shown exactly (never masked) but must not drive the
    terminal.
    """
    return _UNSAFE_RE.sub(_escape_one, text)


def escape_line(text: str) -> str:
    """``text`` on one line: as :func:`escape_controls`, and the newline written as ``\\n``
    too. For a log record: no text can start a line of its own."""
    return _LINE_UNSAFE_RE.sub(_escape_one, text)


def escape_json(text: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``) with every character
    :func:`escape_controls` escapes written as a JSON escape (``\\u009b``, ``\\u202e``, a
    surrogate pair beyond): the same JSON value, and nothing that drives a terminal (a C1
    CSI, a bidi override, a line separator). Such characters only occur inside strings of
    JSON text, where an escape means the same character."""
    return _UNSAFE_RE.sub(_json_escape_one, text)  # the newlines are the JSON's own layout


def _json_escape_one(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _escape_one(match: re.Match[str]) -> str:
    char = match.group(0)
    code = ord(char)
    if char == "\n":
        return "\\n"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def for_terminal(text: str, url: str | None = None) -> str:
    """Untrusted text as a terminal may show it: escaped, then masked (:func:`scrub`).

    Escaping first joins what a control character split, so a secret cut by a tab is masked
    whole, and the result is a fixed point (showing it again changes nothing).
    """
    return scrub(escape_controls(text), url)
