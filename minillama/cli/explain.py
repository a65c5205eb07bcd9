"""``minillama explain [NAME]``: one equation of the model at the terminal, with everything that
computes and checks it.

For a name (``rmsnorm``, ``rope``, ``attention``, ``q4_k``, ``adamw``, ...) it prints first the
math, forward and backward (the section of docs/MATH.md in a checkout of the repository, else
the reference functions' docstrings), then the reference code; after them the backends that
replace it (``file:function``) and what docs/KERNELS.md says about how they compute it, the
tests that hold it and the identities of ``minillama.identities`` that use it. Without a
name it lists the names. The sources are read where the project keeps them
(:mod:`minillama.mathmap`), so what it prints is what ``tests/mathmap/test_math_map.py`` checks.
"""

from __future__ import annotations

import textwrap

from minillama.cli.main import plain_text
from minillama.mathmap import (
    ENTRIES,
    Entry,
    Sources,
    docstring,
    identities_for,
    kernel_passages,
    lookup,
    math_passages,
    source,
    tests_for,
)
from minillama.mathmap.mathtext import to_text
from minillama.mathmap.overrides import backend_classes, op_attributes

WIDTH = 100


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "explain", help="an equation of the model: its math, reference code, backends and tests",
        description="Show one equation of the model: the math (forward and backward) from "
                    "docs/MATH.md, or from the reference functions' docstrings where the "
                    "package is installed without its docs; the reference code; which backends "
                    "replace it (file:function); the tests and identities that hold it. "
                    "Without NAME, list the names.")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="what to explain: rmsnorm, rope, attention, swiglu, cross_entropy, "
                        "lora, q4_k and more (case-insensitive; `minillama explain` lists "
                        "them all)")
    p.add_argument("--latex", action="store_true",
                   help="print the math as written (LaTeX and Markdown) instead of plain text")
    p.set_defaults(func=run_explain)


def run_explain(args) -> int:
    print(listing() if args.name is None else explain(args.name, latex=args.latex))
    return 0


def listing() -> str:
    """Every name with its title and aliases."""
    lines = ["Equations `minillama explain NAME` shows, in the order of docs/MATH.md:", ""]
    for e in ENTRIES:
        also = f" (also: {', '.join(e.aliases)})" if e.aliases else ""
        lines += textwrap.wrap(f"{e.name:<22}{e.title}{also}", WIDTH, initial_indent="  ",
                               subsequent_indent=" " * 24)
    lines += ["", "Names are case-insensitive; a function's name works too "
                  "(rmsnorm_forward, dequantize_q4_k)."]
    return "\n".join(lines)


def _heading(text: str) -> list[str]:
    return ["", text, "-" * len(text)]


def _readable(text: str, latex: bool) -> str:
    return text if latex else to_text(text)


def equations(entry: Entry, sources: Sources, latex: bool = False) -> list[str]:
    """The math of ``entry``: docs/MATH.md's passages where the file is there, else the
    docstrings of its code."""
    passages = math_passages(entry, sources.math) if sources.math is not None else []
    if passages:
        lines = _heading("Equations (docs/MATH.md)")
        for text in passages:
            lines += ["", _readable(text, latex)]
        return lines
    lines = _heading("Equations (the docstrings of the reference code; docs/MATH.md is not "
                     "installed)")
    for cite in entry.code:
        doc = docstring(sources, cite)
        if doc:
            body = _readable(plain_text(doc).strip(), latex)
            lines += ["", cite, textwrap.indent(body, "    ")]
    return lines


def code(entry: Entry, sources: Sources) -> list[str]:
    lines = _heading("Reference code" if entry.code[0].startswith("minillama/") else "Code")
    for cite in entry.code:
        lines += ["", f"# {cite}", source(sources, cite)]
    return lines


def backends(entry: Entry, sources: Sources) -> list[str]:
    """The backends' own code for ``entry``: the op attributes a backend class replaces, and the
    other backend code the entry names."""
    classes = backend_classes(sources.package, sources.backends)
    impls = classes.overrides(op_attributes(entry.replaceable(), classes))
    found = [(i.backend, i.where + (f" (as {i.attr})" if not i.where.endswith(i.attr) else "")
              + (f" (inherited from {i.owner})" if i.owner != i.backend else ""))
             for i in impls]
    found += [(cite.split("/")[1], cite) for cite in entry.related]
    lines = _heading("Backends that replace it")
    if not found:
        return lines + ["  none: every backend runs the code above"]
    lines += [f"  {backend:<10} {where}" for backend, where in found]
    if impls:
        lines.append(f"  {'reference':<10} runs the reference code above")
    return lines


def backend_notes(entry: Entry, sources: Sources, latex: bool = False) -> list[str]:
    """What docs/KERNELS.md says about the backends' code for ``entry`` (nothing without the
    file, as in a wheel)."""
    if sources.kernels is None:
        return []
    classes = backend_classes(sources.package, sources.backends)
    impls = classes.overrides(op_attributes(entry.replaceable(), classes))
    passages = kernel_passages(entry, sources.kernels, [i.where for i in impls])
    if not passages:
        return []
    lines = _heading("How the backends compute it (docs/KERNELS.md)")
    for text in passages:
        lines += ["", _readable(text, latex)]
    return lines


def tests(entry: Entry, sources: Sources) -> list[str]:
    lines = _heading("Tests that hold it")
    found = tests_for(entry, sources)
    if found is None:
        return lines + textwrap.wrap("no tests/ folder here: the installed package ships "
                                     "without its tests (a checkout of the repository has "
                                     "them)", WIDTH, initial_indent="  ", subsequent_indent="  ")
    if not found:
        return lines + ["  no test calls this code by name"]
    by_file: dict[str, list[str]] = {}
    for use in found:
        by_file.setdefault(use.file, []).append(use.name)
    for file, names in by_file.items():
        lines += textwrap.wrap(f"{file}: {', '.join(names)}", WIDTH, initial_indent="  ",
                               subsequent_indent="      ", break_on_hyphens=False)
    return lines


def identities(entry: Entry) -> list[str]:
    lines = _heading("Identities that use it")
    about, through = identities_for(entry)
    if not about and not through:
        return lines + ["  none of the catalog's identities uses it"]
    for ident in about:
        statement, topic = ident.statement.strip(), ident.topic
        head = ident.name + (f" [{topic}]" if topic else "")
        lines += textwrap.wrap(f"{head}: {statement}" if statement else head, WIDTH,
                               initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False)
    if through:
        names = ", ".join(i.name for i in through)
        lines += textwrap.wrap(f"through a whole model or more ops: {names}", WIDTH,
                               initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False)
    return lines


def explain(name: str, sources: Sources | None = None, latex: bool = False) -> str:
    """Everything ``minillama explain NAME`` prints for ``name``."""
    entry = lookup(name)
    sources = sources or Sources.installed()
    lines = [f"{entry.name}: {entry.title}"]
    lines += equations(entry, sources, latex) + code(entry, sources)
    lines += backends(entry, sources) + backend_notes(entry, sources, latex)
    lines += tests(entry, sources) + identities(entry)
    return "\n".join(lines)
