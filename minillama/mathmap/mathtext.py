r"""LaTeX and Markdown of docs/MATH.md and of the reference docstrings as plain terminal text.

:func:`to_text` turns ``$$\bar{x} = r\left(u - \hat{x}\, \frac{1}{D}\sum_i u_i \hat{x}_i\right)$$``
into ``x̄ = r(u - x̂ (1/D) Σ_i u_i x̂_i)``: Greek letters and operators become their Unicode
symbols, accents combining marks, ``\frac`` a slash, ``\sqrt`` a radical, simple superscripts
superscript digits, matrices and cases one bracketed line; markup the terminal cannot show
(``$``, ``**``, backticks, sizing and spacing commands) is dropped. It reads only what the math
map uses; an unknown command prints as its name (``\tanh`` -> ``tanh``).
"""

from __future__ import annotations

import re

SYMBOLS = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "varepsilon": "ε",
    "zeta": "ζ", "eta": "η", "theta": "θ", "vartheta": "ϑ", "iota": "ι", "kappa": "κ",
    "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ", "pi": "π", "rho": "ρ", "sigma": "σ",
    "tau": "τ", "upsilon": "υ", "phi": "φ", "varphi": "φ", "chi": "χ", "psi": "ψ",
    "omega": "ω", "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ", "Xi": "Ξ",
    "Pi": "Π", "Sigma": "Σ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω", "ell": "ℓ",
    "odot": "⊙", "otimes": "⊗", "oplus": "⊕", "cdot": "·", "times": "×", "div": "÷",
    "pm": "±", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "ne": "≠", "neq": "≠",
    "approx": "≈", "sim": "∼", "equiv": "≡", "propto": "∝", "in": "∈", "notin": "∉",
    "subset": "⊂", "cup": "∪", "cap": "∩", "sum": "Σ", "prod": "∏", "int": "∫",
    "infty": "∞", "partial": "∂", "nabla": "∇", "to": "→", "rightarrow": "→",
    "leftarrow": "←", "Rightarrow": "⇒", "mapsto": "↦", "gg": "≫", "ll": "≪",
    "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈", "rceil": "⌉", "langle": "⟨", "rangle": "⟩",
    "lVert": "‖", "rVert": "‖", "Vert": "‖", "|": "‖", "mid": "|", "top": "⊤",
    "ldots": "…", "cdots": "⋯", "dots": "…", "forall": "∀", "exists": "∃", "neg": "¬",
    "quad": "  ", "qquad": "    ", ",": " ", ";": " ", ":": " ", " ": " ", "!": "",
    "{": "{", "}": "}", "_": "_", "%": "%", "&": "&", "#": "#", "$": "$",
}
#: accents: the combining mark placed after a one-letter argument
ACCENTS = {"bar": "\u0304", "overline": "\u0305", "hat": "\u0302", "widehat": "\u0302",
           "tilde": "\u0303", "widetilde": "\u0303", "dot": "\u0307", "vec": "\u20d7"}
#: commands whose one argument prints as it is
PLAIN_ARG = {"mathrm", "text", "textrm", "mathit", "mathbf", "mathsf", "mathtt", "texttt",
             "operatorname", "boldsymbol", "mathcal", "mathrel", "mathop", "mathbin", "emph"}
BLACKBOARD = {"R": "ℝ", "N": "ℕ", "Z": "ℤ", "Q": "ℚ", "C": "ℂ"}
#: commands that only size or space what follows: dropped
DROPPED = {"left", "right", "bigl", "bigr", "Bigl", "Bigr", "biggl", "biggr", "big", "Big",
           "bigg", "textstyle", "displaystyle", "scriptstyle", "limits", "nolimits"}
#: what may follow a fraction written as a/b without parentheses
FRAC_ENDS = " ,.;:)]}|=+-*/"
SUPERSCRIPT = dict(zip("0123456789+-=()niT⊤", "⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱᵀᵀ"))
ENVIRONMENT = re.compile(r"\\begin\{(pmatrix|bmatrix|matrix|cases)\}(.*?)\\end\{\1\}", re.S)
#: control characters (a backslash-b or -f read as an escape by Python) that would garble output
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _environment(m: re.Match) -> str:
    """A matrix as ``[a, b; c, d]``, cases as ``{ value (condition); ... }``."""
    rows = [row.strip() for row in re.split(r"\\\\", m.group(2)) if row.strip()]
    cells = [[c.strip() for c in row.split("&")] for row in rows]
    if m.group(1) == "cases":
        return r"\{ " + "; ".join(c[0] + (f"  ({', '.join(c[1:])})" if len(c) > 1 else "")
                                   for c in cells) + r" \}"
    return "[" + "; ".join(", ".join(c) for c in cells) + "]"


def _atomic(text: str) -> bool:
    """Whether ``text`` reads as one symbol: a word, a number, an accented letter, or a call
    such as ``√(x + ε)`` whose parenthesis closes at the end."""
    if re.fullmatch(r"[\w.\u0300-\u036f\u20d7′']+", text):
        return True
    m = re.match(r"[\w√\u0300-\u036f]*\(", text)
    if not m or not text.endswith(")"):
        return False
    depth = 0
    for i in range(m.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i == len(text) - 1
    return False


def _wrap(text: str) -> str:
    return text if _atomic(text) else f"({text})"


class _Reader:
    """A left-to-right reader of one LaTeX string; :meth:`run` returns its plain text."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def run(self, closing: str | None = None) -> str:
        out: list[str] = []
        while self.i < len(self.s):
            ch = self.s[self.i]
            if ch == closing:
                self.i += 1
                break
            out.append(self._item())
        return "".join(out)

    def _item(self) -> str:
        ch = self.s[self.i]
        self.i += 1
        if ch == "\\":
            return self._command()
        if ch == "{":
            return self.run("}")
        if ch == "^":
            return self._superscript(self._argument())
        if ch == "_":
            sub = self._argument()
            return f"_{sub}" if len(sub) <= 1 else f"_{{{sub}}}"
        return ch

    def _argument(self) -> str:
        """One argument: a braced group, a command, or one character (spaces skipped)."""
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        if self.i >= len(self.s):
            return ""
        return self._item()

    def _name(self) -> str:
        m = re.match(r"[A-Za-z]+|.", self.s[self.i:], re.S)
        if not m:
            return ""
        self.i += len(m.group(0))
        return m.group(0)

    def _command(self) -> str:
        name = self._name()
        if name in ("frac", "dfrac", "tfrac"):
            num, den = _wrap(self._argument()), _wrap(self._argument())
            follows = self.s[self.i:self.i + 1]  # glued to what follows: parenthesised
            return f"({num}/{den})" if follows and follows not in FRAC_ENDS else f"{num}/{den}"
        if name == "sqrt":
            return "√" + _wrap(self._argument())
        if name in ACCENTS:
            arg = self._argument()
            one = re.fullmatch(r".[\u0300-\u036f\u20d7]*", arg)  # a letter, maybe accented
            return arg + ACCENTS[name] if one else f"{name}({arg})"
        if name == "mathbb":
            arg = self._argument()
            return BLACKBOARD.get(arg, arg)
        if name in PLAIN_ARG:
            return self._argument()
        if name in ("underbrace", "overbrace"):
            body = self._argument()
            if self.s[self.i:self.i + 1] in ("_", "^"):  # the brace's label is dropped
                self.i += 1
                self._argument()
            return body
        if name in DROPPED:
            if self.s[self.i:self.i + 1] == ".":
                self.i += 1
            return ""
        word = SYMBOLS.get(name, name)
        follows = self.s[self.i:self.i + 1]
        if len(word) > 1 and word.isalpha() and (follows.isalnum() or follows == "\\"):
            return word + " "  # \cos\varphi: cos φ
        return word

    @staticmethod
    def _superscript(text: str) -> str:
        if text and all(c in SUPERSCRIPT for c in text):
            return "".join(SUPERSCRIPT[c] for c in text)
        return "^" + _wrap(text)


def latex_to_text(text: str) -> str:
    """LaTeX math (with or without ``$`` delimiters) as plain text."""
    text = ENVIRONMENT.sub(_environment, CONTROL.sub("", text.replace("\t", " ")))
    return _Reader(text.replace("$", "")).run()


def to_text(markdown: str) -> str:
    """A passage of docs/MATH.md (or a docstring) as plain text: its math through
    :func:`latex_to_text`, code spans as they are, bold and code markup dropped, a display
    equation (a line that starts with ``$$``) indented by four spaces."""
    lines = []
    markdown = ENVIRONMENT.sub(_environment, markdown)
    for line in markdown.splitlines():
        display = line.lstrip().startswith("$$")
        # odd parts: the code spans (`x` or ``x``), printed as they are
        parts = line.replace("**", "").replace("``", "`").split("`")
        line = "".join(part if i % 2 else latex_to_text(part) for i, part in enumerate(parts))
        lines.append("    " + line.strip() if display else line.rstrip())
    return "\n".join(lines)
