"""MkDocs hook: the reference pages, generated from the code at build time
(connectors/devtools/reference.py), and the benchmark report (bench/REPORT.md with its plots),
added to the site as pages of their own. Nothing generated is written into docs/."""

from __future__ import annotations

import os

from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on_files(files: Files, config) -> Files:
    from kcompact.connectors.devtools.reference import PAGES
    for path, write in PAGES.items():
        files.append(File.generated(config, path, content=write()))
    bench = os.path.join(ROOT, "bench")
    with open(os.path.join(bench, "REPORT.md"), encoding="utf-8") as f:
        files.append(File.generated(config, "benchmarks/report.md", content=f.read()))
    for name in sorted(os.listdir(bench)):
        if name.endswith(".png"):
            files.append(File.generated(config, f"benchmarks/{name}",
                                        abs_src_path=os.path.join(bench, name)))
    return files
