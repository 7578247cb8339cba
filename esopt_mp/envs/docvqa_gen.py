"""Synthetic DocVQA documents, seeded: invoices/receipts, forms and tables rendered with DejaVu fonts.

Nothing is downloaded: the whole DocVQA path (OCR in the sandbox, ANLS) runs on CPU with these. Each row is in
the public DocVQA format ``{id, question, answers: [...], image}`` plus ``label`` / ``column`` (where the answer
sits: a label on the page, a table column) that only scripted test agents use. The answer always appears on the
page as rendered text.
"""
from __future__ import annotations

import json
import os
import random

FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF")
FIRST = ["Anna", "Brian", "Carla", "David", "Elena", "Frank", "Grace", "Henry", "Irene", "James", "Karen", "Louis"]
LAST = ["Smith", "Turner", "Walker", "Morgan", "Hughes", "Parker", "Bennett", "Foster", "Howard", "Palmer"]
CITIES = ["Springfield", "Riverton", "Lakewood", "Fairview", "Greenville", "Madison", "Clinton", "Franklin"]
ITEMS = ["Paper", "Toner", "Stapler", "Folders", "Envelopes", "Pens", "Binders", "Labels", "Markers", "Tape"]
COMPANIES = ["Acme Supplies", "Northwind Traders", "Globex Office", "Initech Services", "Umbrella Retail"]
REGIONS = ["North", "South", "East", "West", "Central"]


def font_path(name: str = "DejaVuSans.ttf") -> str:
    """The DejaVu font file (Debian ``fonts-dejavu-core``); a clear error when it is not installed."""
    for d in FONT_DIRS:
        p = os.path.join(d, name)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"font {name} not found in {FONT_DIRS}: apt-get install fonts-dejavu-core")


def _money(rng) -> str:
    return f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}"


def _date(rng) -> str:
    return f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(2015, 2025)}"


def _invoice(rng):
    company, number = rng.choice(COMPANIES), f"INV-{rng.randint(10000, 99999)}"
    items = [(it, rng.randint(1, 9), _money(rng)) for it in rng.sample(ITEMS, rng.randint(2, 4))]
    total = f"{sum(q * float(p) for _, q, p in items):.2f}"
    lines = [("title", company), ("", ""), ("kv", ("Invoice No", number)), ("kv", ("Date", _date(rng))),
             ("kv", ("Customer", f"{rng.choice(FIRST)} {rng.choice(LAST)}")), ("", "")]
    lines += [("row", (name, f"x{q}", price)) for name, q, price in items]
    lines += [("", ""), ("kv", ("Total", total))]
    qa = [("What is the invoice number?", number, "Invoice No"), ("What is the invoice date?", None, "Date"),
          ("Who is the customer?", None, "Customer"), ("What is the total amount?", total, "Total"),
          ("Which company issued the invoice?", company, None)]
    return lines, qa


def _form(rng):
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    phone = f"{rng.randint(200, 999)}-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
    fields = [("Name", name), ("Date of Birth", _date(rng)), ("City", rng.choice(CITIES)), ("Phone", phone),
              ("Employer", rng.choice(COMPANIES)), ("Member ID", str(rng.randint(100000, 999999)))]
    lines = [("title", "Registration Form"), ("", "")] + [("kv", f) for f in fields]
    qa = [("What is the applicant's name?", None, "Name"), ("What is the date of birth?", None, "Date of Birth"),
          ("In which city does the applicant live?", None, "City"), ("What is the phone number?", None, "Phone"),
          ("Who is the employer?", None, "Employer"), ("What is the member ID?", None, "Member ID")]
    return lines, qa


def _table(rng):
    year = rng.randint(2015, 2025)
    cols = ["Q1", "Q2", "Q3", "Q4"]
    rows = [(r, [str(rng.randint(100, 9999)) for _ in cols]) for r in rng.sample(REGIONS, 4)]
    lines = [("title", f"Sales by Region {year}"), ("", ""), ("row", ("Region", *cols))]
    lines += [("row", (r, *vals)) for r, vals in rows]
    r, vals = rng.choice(rows)
    c = rng.randrange(len(cols))
    return lines, [(f"What were the {r} sales in {cols[c]}?", vals[c], (r, c + 1))]


def _render(lines, path: str, rng) -> None:
    from PIL import Image, ImageDraw, ImageFont

    size = rng.choice((26, 28, 30))
    font, bold = ImageFont.truetype(font_path(), size), ImageFont.truetype(font_path("DejaVuSans-Bold.ttf"), size + 6)
    step = int(size * 1.6)
    img = Image.new("L", (900, 80 + step * len(lines)), 255)
    draw = ImageDraw.Draw(img)
    y = 40
    for kind, val in lines:
        if kind == "title":
            draw.text((40, y), val, font=bold, fill=0)
        elif kind == "kv":
            draw.text((40, y), f"{val[0]}:", font=font, fill=0)
            draw.text((360, y), val[1], font=font, fill=0)
        elif kind == "row":
            for i, cell in enumerate(val):
                draw.text((40 + i * (200 if len(val) > 3 else 260), y), cell, font=font, fill=0)
        y += step
    img.save(path)


def generate(n: int, out_dir: str, seed: int = 0) -> list[dict]:
    """``n`` question rows over freshly rendered documents in ``out_dir`` (one image per row, reused if present)."""
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        lines, qa = rng.choice((_invoice, _form, _table))(rng)
        kv = {v[0]: v[1] for k, v in lines if k == "kv"}
        question, answer, where = rng.choice(qa)
        answer = answer if answer is not None else kv[where]
        doc = f"doc-s{seed}-{i:05d}"
        path = os.path.join(out_dir, f"{doc}.png")
        doc_rng = random.Random(f"{seed}:{i}")  # rendering choices independent of the question stream
        if not os.path.exists(path):
            _render(lines, path, doc_rng)
        row = {"id": f"{doc}-q", "question": question, "answers": [answer], "image": os.path.realpath(path)}
        if answer.replace(".", "").isdigit() and "." in answer:
            row["answers"].append(f"${answer}")
        if isinstance(where, tuple):
            row["label"], row["column"] = where
        else:
            row["label"] = where
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str) -> None:
    """Rows as JSONL with image paths relative to the file (the layout :func:`docvqa.load_jsonl` reads)."""
    base = os.path.dirname(os.path.abspath(path))
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "image": os.path.relpath(r["image"], base)}) + "\n")
