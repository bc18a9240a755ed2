#!/bin/bash
python3 - <<'PY'
import csv, json
from decimal import Decimal, ROUND_HALF_UP
totals = {}
for row in csv.DictReader(open("/app/sales.csv")):
    if not row["units"].isdigit():
        continue
    totals[row["region"]] = totals.get(row["region"], Decimal(0)) + int(row["units"]) * Decimal(row["unit_price"])
out = {region: float(totals[region].quantize(Decimal("0.01"), ROUND_HALF_UP)) for region in sorted(totals)}
json.dump(out, open("/app/totals.json", "w"), indent=2)
PY
