import csv
import json
from decimal import Decimal
from pathlib import Path

EXPECTED = json.loads(Path(__file__).with_name("data").joinpath("expected.json").read_text())


def totals_file():
    return json.loads(Path("/app/totals.json").read_text())


def test_input_is_untouched():
    rows = list(csv.DictReader(Path("/app/sales.csv").open()))
    assert len(rows) == 40


def test_totals_are_right():
    assert totals_file() == EXPECTED


def test_regions_in_order():
    assert list(totals_file()) == sorted(EXPECTED)


def test_invalid_rows_left_out():
    # the two rows with units "three" and "2.5" count for nothing
    assert Decimal(str(sum(totals_file().values()))).quantize(Decimal("0.01")) == Decimal(
        str(sum(EXPECTED.values()))
    ).quantize(Decimal("0.01"))
