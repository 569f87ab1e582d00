"""What the PDF of the book (``make pdf``, Sphinx's LaTeX builder) needs that
the HTML does not.

The print fixes 1-4 act on the LaTeX builder only; the HTML book is untouched
by them. Item 5 is the HTML book's link to the PDF.

1. Proofs read as proofs. sphinx-proof wraps a ``{prf:proof}`` in an admonition
   with no title, which LaTeX draws as a box with an empty title bar. In print
   a proof follows its theorem as plain text: "*Proof.*" in italics, and a
   square at its end.
2. Solutions show their code. A solution's text says "the code is in the cell
   below", and the HTML folds that cell's source (``hide-input``) so that a
   reader on the page meets the answer only on request;
   sphinx-jupyterbook-latex drops hidden sources from the PDF altogether. In a
   section that holds solutions, a hidden source is printed, and so is a
   hidden output (``hide-output``: the package's source of an answer, shown
   by ``show_source`` beside a solution, is folded on the page). (Elsewhere
   ``hide-input`` hides plotting code, and the PDF keeps hiding it: the figure
   is what the reader needs.)
3. Long lines fit the page. Code and outputs are set in ``\\small`` monospace,
   which holds about 82 characters across the text block; a longer line is
   wrapped with a continuation arrow, which breaks up tables and aligned
   columns. A block whose longest line is too long for ``\\small`` is set in
   the largest smaller size at which it fits, down to 6 pt (122 characters); a
   block with longer lines still is set in 6 pt and wrapped.
4. Every character prints. xelatex sets a character its font lacks as nothing
   at all, with only a line in its log. The book's fonts (FreeSerif, FreeMono)
   have no emoji: each character of ``SUBSTITUTES`` is printed as the nearest
   character they have (``\\newunicodechar``), and ``tests/test_pdf.py`` fails
   on any "Missing character" in the log.
5. The link to the PDF. The GitHub Pages workflow publishes the PDF beside the
   HTML book, at the site's root; the substitution ``{{ pdf_link }}``
   (book/intro.md) links to it there, at the address GitHub Pages gives the
   repository of ``_config.yml`` (https://OWNER.github.io/REPO/). The address
   is absolute, so that ``make book`` and the link check, which run without the
   PDF (``make pdf`` needs TeX), see an external link instead of a missing
   file.
6. A theorem starts where it has room: ``\\needspace`` before each
   theorem, lemma, proposition and corollary moves it to the next page when
   fewer than 12 lines are left (``tests/test_pdf.py`` checks the footers).
7. Code in a box breaks across pages. Inside an exercise or a solution box,
   Sphinx frames a code block in a minipage, which TeX cannot break,
   whenever it judges that the block fits on the page. It judges by the page
   totals, which do not move while TeX collects the box's contents, so a
   block near the foot of a page, or one taller than a page, ran into the
   footer (by 15 to 97 pt in chapter 7's solutions, and a five-line block by
   25 pt in chapter 4's). ``NESTED_VERBATIM_PATCH`` sets every code block
   inside a box unframed, as lines that break anywhere; the box's own frame
   sets it off. A code block outside the boxes keeps its frame (Sphinx's
   framing there breaks across pages).
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

# Characters of monospace that fit across a code or output block, by font size:
# measured in the PDF at \small (9 pt: 82 characters in an output box, a few
# more in an input box); the smaller sizes scale by the ratio of the font
# sizes, less a character of safety.
FITS = (
    (None, 81),
    (r"\footnotesize", 91),
    (r"\scriptsize", 104),
    (r"\fontsize{6}{7.5}\selectfont", 122),
)


def font_size_for(text: str, boxed: bool = False) -> str | None:
    """The LaTeX font size to set a verbatim block in, or None for the default
    (``\\small``).

    ``boxed``: the block is inside a box (an exercise, a solution), whose
    padding takes about four characters of the width.
    """
    longest = max(
        (len(line.rstrip()) for line in text.splitlines()), default=0
    ) + (4 if boxed else 0)
    for size, width in FITS:
        if longest <= width:
            return size
    return FITS[-1][0]


# Characters of the book that its fonts lack -> the character printed instead
# (chapter 1 shows the tokenizer an emoji; FreeMono has the white smiling face
# of U+263A).
SUBSTITUTES = {"\N{SLIGHTLY SMILING FACE}": "\N{WHITE SMILING FACE}"}


def substitutes_preamble(substitutes: dict[str, str] = SUBSTITUTES) -> str:
    """LaTeX that prints each key of ``substitutes`` as its value (package
    newunicodechar)."""
    lines = [r"\usepackage{newunicodechar}"]
    lines += [
        rf"\newunicodechar{{{char}}}{{{instead}}}"
        for char, instead in substitutes.items()
    ]
    return "\n".join(lines) + "\n"


# The test at the end of Sphinx's sphinxVerbatim (sphinxlatexliterals.sty,
# Sphinx 5.1 to 8) that sets a block nested in a box unframed when it does
# not fit: "block + page total > page goal". With the stale page totals
# replaced by a test that always holds, every nested block is set unframed.
# The build stops with an error if Sphinx's macro no longer holds the test.
NESTED_VERBATIM_PATCH = (
    "\\usepackage{etoolbox}\n"
    "\\patchcmd{\\endsphinxVerbatim}"
    "{\\pagetotal+\\pagedepth>\\pagegoal}"
    "{0pt>-1pt}{}"
    "{\\errmessage{book_latex: Sphinx's sphinxVerbatim has changed; "
    "update NESTED_VERBATIM_PATCH}}\n"
)


def _print_substitutes(app, config) -> None:
    elements = dict(config.latex_elements)
    elements["preamble"] = (
        elements.get("preamble", "")
        + substitutes_preamble()
        + NESTED_VERBATIM_PATCH
    )
    config.latex_elements = elements


# latex_documents' targetname in _config.yml, as a PDF
PDF_NAME = "attention-derived.pdf"


def published_pdf_url(repository_url: str) -> str:
    """Where the Pages workflow publishes the PDF, for the repository at
    ``repository_url``."""
    match = re.fullmatch(
        r"https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?", repository_url
    )
    if not match:
        raise ValueError(
            f"not a GitHub repository address: {repository_url!r}"
        )
    owner, repo = match.groups()
    return f"https://{owner.lower()}.github.io/{repo}/{PDF_NAME}"


def _link_the_pdf(app, config) -> None:
    url = published_pdf_url(
        config.html_theme_options.get("repository_url", "")
    )
    config.myst_substitutions = {
        **config.myst_substitutions,
        "pdf_link": f"[the whole book as one PDF]({url})",
    }


def _ancestors(node: nodes.Node):
    while node.parent is not None:
        node = node.parent
        yield node


def _is_solution(node: nodes.Node) -> bool:
    return type(node).__name__ in ("solution_node", "solution_start_node")


# sphinx-proof's boxes that state a result; each needs this much room left on
# its page, or it starts on the next one (a theorem whose display ran over the
# page's foot printed 16 pt into the footer)
THEOREM_KINDS = {"theorem", "lemma", "proposition", "corollary"}
THEOREM_ROOM = "\\needspace{12\\baselineskip}\n"


class PrintFixes(SphinxPostTransform):
    """Runs before sphinx-jupyterbook-latex (priority 400), which drops hidden
    cell sources."""

    default_priority = 350
    builders = ("latex",)

    def run(self, **kwargs) -> None:
        self.show_solution_sources()
        self.theorems_start_with_room()
        self.plain_proofs()
        self.fit_verbatim()

    def theorems_start_with_room(self) -> None:
        # sphinx-proof's boxes are nodes of their own, Admonition subclasses
        for box in list(self.document.findall(nodes.Admonition)):
            kinds = {*box["classes"], type(box).__name__.removesuffix("_node")}
            if THEOREM_KINDS & kinds and box.parent is not None:
                box.parent.insert(
                    box.parent.index(box),
                    nodes.raw("", THEOREM_ROOM, format="latex"),
                )

    def show_solution_sources(self) -> None:
        for section in list(self.document.findall(nodes.section)):
            if not any(_is_solution(child) for child in section.children):
                continue
            # a solution's cells sit beside it in the section, or inside it
            # when the solution is gated ({solution-start} ... {solution-end})
            inside = [
                cell
                for child in section.children
                if _is_solution(child)
                for cell in child.findall(nodes.container)
            ]
            for child in [*section.children, *inside]:
                if not isinstance(child, nodes.container):
                    continue
                for tag in ("tag_hide-input", "tag_hide-output"):
                    if tag in child["classes"]:
                        child["classes"].remove(tag)

    def plain_proofs(self) -> None:
        for box in list(self.document.findall(nodes.admonition)):
            if "proof" not in box["classes"] or any(
                isinstance(c, nodes.title) for c in box.children
            ):
                continue
            body = list(box.children)
            first = body[0] if body else None
            if (
                isinstance(first, nodes.paragraph)
                and first.children
                and isinstance(first[0], nodes.Text)
                and first[0].astext().startswith("Proof. ")
            ):
                # sphinx-proof puts "Proof. " before the proof's first line
                rest = first[0].astext()[len("Proof. ") :]
                first.replace(first[0], nodes.Text(rest))
                first.insert(0, nodes.emphasis(text="Proof."))
                first.insert(1, nodes.Text(" "))
            qed = nodes.raw(
                "", r"\nobreak\hfill\ensuremath{\square}", format="latex"
            )
            if body and isinstance(body[-1], nodes.paragraph):
                body[-1] += qed
            else:
                body.append(nodes.paragraph("", "", qed))
            box.replace_self(body)

    def fit_verbatim(self) -> None:
        for block in list(self.document.findall(nodes.literal_block)):
            boxed = any(
                isinstance(a, nodes.Admonition) for a in _ancestors(block)
            )
            size = font_size_for(block.astext(), boxed)
            if size is None or block.parent is None:
                continue
            parent, index = block.parent, block.parent.index(block)
            parent.insert(
                index + 1, nodes.raw("", "\\endgroup\n", format="latex")
            )
            parent.insert(
                index,
                nodes.raw(
                    "",
                    f"\\begingroup\\fvset{{fontsize={size}}}\n",
                    format="latex",
                ),
            )


def setup(app):
    app.add_post_transform(PrintFixes)
    app.connect("config-inited", _link_the_pdf)
    app.connect("config-inited", _print_substitutes)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
