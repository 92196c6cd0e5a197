"""Replace a generated section of docs/benchmarks.md between <!-- NAME:start --> and <!-- NAME:end -->."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def replace_section(marker: str, body: str, markdown: Path = BENCHMARKS) -> None:
    """Put ``body`` between the markers (appending the block when the markers are missing)."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    markdown.write_text(text)
