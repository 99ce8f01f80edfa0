"""Regenerate the King James texts the recipes use, from Debian's `bible-kjv` package.

    apt-get install bible-kjv && python recipes/data/make_kjv.py

kjv-ot-train.txt.gz: the Old Testament without Joshua (pretraining and fine-tuning text);
kjv-joshua.txt.gz: the book of Joshua (held-out evaluation text, never trained on).
One verse per line, the verse references dropped, a blank line between chapters and books.
The King James Version is in the public domain.
"""

import gzip
import re
import subprocess
from pathlib import Path

HELD_OUT = "Josh"
LAST_OT_BOOK = "Mal"


def main() -> None:
    lines = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    books: dict[str, list[str]] = {}
    for line in lines:
        ref, text = line.split(" ", 1)
        book, _chapter, verse = re.fullmatch(r"(\d?[A-Za-z]+)(\d+):(\d+)", ref).groups()
        verses = books.setdefault(book, [])
        if verse == "1" and verses:
            verses.append("")
        verses.append(text)
    order = list(books)
    old_testament = order[: order.index(LAST_OT_BOOK) + 1]
    here = Path(__file__).parent
    for name, chosen in (("kjv-ot-train", [b for b in old_testament if b != HELD_OUT]),
                         ("kjv-joshua", [HELD_OUT])):
        text = "\n\n".join("\n".join(books[b]) for b in chosen) + "\n"
        # mtime=0: the same text gives the same bytes (a reproducible file)
        (here / f"{name}.txt.gz").write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))


if __name__ == "__main__":
    main()
