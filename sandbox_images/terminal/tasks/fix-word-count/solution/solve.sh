#!/bin/bash
python3 - <<'PY'
from pathlib import Path
path = Path("/app/wordfreq.py")
source = path.read_text()
source = source.replace(
    "    return text.split()",
    "    found = (word.strip(\".,;:!?\\\"'()-\").lower() for word in text.split())\n"
    "    return [word for word in found if word]",
)
source = source.replace(
    "key=lambda item: item[1], reverse=True)[: n - 1]", "key=lambda item: (-item[1], item[0]))[:n]"
)
path.write_text(source)
PY
