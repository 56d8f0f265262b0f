"""Tree-mask benchmark: ``python bench/tree.py DIR [options]`` = ``espalier bench-tree DIR ...``.

See ``server/cli_bench_tree.py`` for what is measured; prints JSON lines, the last one a summary.
"""

from __future__ import annotations

import sys

from espalier.server.main import main

if __name__ == "__main__":
    raise SystemExit(main(["bench-tree", *sys.argv[1:]]))
