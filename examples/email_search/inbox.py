"""A synthetic inbox, generated from a seed, in SQLite with full-text search (FTS5).

Every inbox mixes emails that carry one fact (a meeting's time and room, an order's number
and price, a flight's number and gate, an invoice's amount, a reservation's code) with
look-alikes: the same kinds of email about other meetings, orders and trips, follow-ups that
name the same meeting or order without the fact, and newsletters. So the question's own words
find the email, but only the right one answers it.

The database holds every inbox the examples use; it is built on first use into a temporary
file (a few thousand rows, well under a second) and removed at exit.
"""

from __future__ import annotations

import atexit
import functools
import os
import random
import re
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

FIRST_NAMES = ["Priya", "Marco", "Lena", "Tomas", "Aisha", "Kenji", "Sofia", "Omar", "Greta", "Diego", "Hana",
               "Felix", "Nadia", "Ravi", "Clara", "Yusuf", "Ingrid", "Mateo", "Zara", "Leon"]
LAST_NAMES = ["Shah", "Rossi", "Berg", "Novak", "Khan", "Sato", "Lopez", "Haddad", "Lund", "Silva", "Kim",
              "Weber", "Petrov", "Iyer", "Moreau", "Aydin", "Okafor", "Larsen", "Costa", "Byrne"]
COMPANIES = ["northwind.com", "acme.io", "globex.net", "initech.com", "lumen.org"]
TOPICS = ["budget", "roadmap", "hiring", "security", "launch", "design", "marketing", "onboarding", "pricing",
          "training", "audit", "partnership", "recruiting", "offsite", "migration", "analytics"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
STORES = ["Parcelio", "ShopNest", "Gadgetry", "HomeHaus", "BookBarn", "Trailhead", "Kitchenly", "Voltmart"]
ITEMS = ["desk lamp", "blender", "backpack", "keyboard", "coffee grinder", "yoga mat", "rain jacket",
         "monitor stand", "kettle", "headphones", "tent", "office chair", "toaster", "webcam"]
CITIES = ["Lisbon", "Denver", "Osaka", "Nairobi", "Toronto", "Krakow", "Austin", "Dublin", "Porto", "Seattle",
          "Madrid", "Helsinki", "Boston", "Prague", "Santiago", "Manila"]
AIRLINES = ["TP", "UA", "JL", "KQ", "AC", "LO", "AA", "EI"]
VENDORS = ["CleanCo", "BrightPrint", "CloudHost", "GreenLeaf", "FastFix", "Sparkle", "DataVault", "PaperTrail"]
SERVICES = ["office cleaning", "printing", "web hosting", "catering", "plumbing repairs", "window cleaning",
            "cloud backups", "document storage"]
RESTAURANTS = ["Luigi's", "Blue Fig", "Sakura House", "Casa Verde", "Copper Pot", "Bombay Spice", "Le Jardin",
               "Harbor Grill"]
NEWSLETTERS = [("Weekly tech digest", "This week: faster laptops, new phones and a look at home networking."),
               ("Your monthly statement is ready", "Log in to your bank to see this month's statement."),
               ("Community garden news", "Spring planting starts soon. Volunteers are welcome on weekends."),
               ("Gym schedule update", "New yoga and spin classes have been added to the evening timetable."),
               ("Book club pick", "This month we are reading a mystery novel. Bring snacks to share."),
               ("Security reminder", "Never share your password. IT will never ask for it by email.")]


@dataclass(frozen=True)
class Email:
    message_id: str
    inbox: str
    sender: str
    date: str
    subject: str
    body: str


@dataclass(frozen=True)
class Question:
    """A question one email of the inbox answers."""

    inbox: str
    message_id: str
    question: str
    answer: str


@dataclass(frozen=True)
class Fact:
    """One fact-bearing email: its text, the questions it answers, and a follow-up without the fact."""

    subject: str
    body: str
    questions: list[tuple[str, str]]  # (question, answer)
    follow_up: tuple[str, str]  # (subject, body) naming the same thing, without the answer


def _time(rng: random.Random) -> str:
    hour = rng.randint(8, 17)  # office hours
    return f"{(hour - 1) % 12 + 1}:{rng.choice(['00', '15', '30', '45'])} {'AM' if hour < 12 else 'PM'}"


def _code(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(length))


def _meeting(rng: random.Random, key: str, first: str) -> Fact:
    day, time, room = rng.choice(WEEKDAYS), _time(rng), f"Room {rng.randint(1, 14)}{rng.choice('ABC')}"
    return Fact(f"{key.capitalize()} meeting on {day}",
                f"Hi {first}, the {key} meeting is on {day} at {time} in {room}. Please bring your notes.",
                [(f"What time is the {key} meeting?", time), (f"Which room is the {key} meeting in?", room)],
                (f"Re: {key} meeting", f"Thanks {first}. I will send the details of the {key} meeting soon."))


def _order(rng: random.Random, key: str, first: str) -> Fact:
    store = rng.choice(STORES)
    number, price = str(rng.randint(100000, 999999)), f"${rng.randint(12, 240)}.{rng.choice(['00', '49', '99'])}"
    return Fact(f"Your {store} order has shipped",
                f"Your {key} (order {number}) shipped today and arrives on {rng.choice(WEEKDAYS)}. "
                f"Total charged: {price}.",
                [(f"What is the order number of my {key}?", number), (f"How much did my {key} cost?", price)],
                (f"Rate your {key}", f"How do you like your new {key}? Tell us in a short review."))


def _flight(rng: random.Random, key: str, first: str) -> Fact:
    flight, gate = f"{rng.choice(AIRLINES)}{rng.randint(100, 1999)}", f"{rng.choice('ABCDE')}{rng.randint(1, 40)}"
    return Fact(f"Flight to {key} confirmed",
                f"Your flight {flight} to {key} leaves on {rng.choice(WEEKDAYS)} at {_time(rng)}. "
                f"Boarding is at gate {gate}.",
                [(f"What is my flight number to {key}?", flight), (f"Which gate does my flight to {key} leave from?",
                                                                    gate)],
                (f"Trip to {key}: packing tips", f"Heading to {key}? Pack light and check the weather first."))


def _invoice(rng: random.Random, key: str, first: str) -> Fact:
    number, amount = f"INV-{rng.randint(1000, 9999)}", f"${rng.randint(80, 2400)}.00"
    service = SERVICES[VENDORS.index(key)]
    return Fact(f"Invoice {number} from {key}",
                f"Please find invoice {number} from {key} for {service}. The amount due is {amount}.",
                [(f"How much is due on the {key} invoice?", amount), (f"What is the number of the {key} invoice?",
                                                                      number)],
                (f"{key} newsletter", f"{key} thanks you for your business. See our new {service} plans."))


def _reservation(rng: random.Random, key: str, first: str) -> Fact:
    time, code = _time(rng), _code(rng, 5)
    return Fact(f"Reservation at {key}",
                f"Your table for {rng.randint(2, 6)} at {key} is booked for {rng.choice(WEEKDAYS)} at {time}. "
                f"Confirmation code: {code}.",
                [(f"What time is my reservation at {key}?", time), (f"What is the confirmation code for {key}?", code)],
                (f"{key} menu", f"{key} has a new menu this season. We hope to see you soon."))


# Each kind of fact-bearing email, and the names its emails are about (unique within an inbox).
KINDS: dict[str, tuple[list[str], Callable[[random.Random, str, str], Fact]]] = {
    "meeting": (TOPICS, _meeting), "order": (ITEMS, _order), "flight": (CITIES, _flight),
    "invoice": (VENDORS, _invoice), "reservation": (RESTAURANTS, _reservation)}


FACTS, FOLLOW_UPS, NEWSLETTERS_PER_INBOX = 8, 4, 4  # 16 emails: small enough to keep tool results short


def generate_inbox(name: str) -> tuple[list[Email], list[Question]]:
    """The emails of inbox `name` and the questions they answer: the same name gives the same inbox."""
    rng = random.Random(f"inbox-{name}")
    owner = rng.choice(FIRST_NAMES)
    people = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES if first != owner]
    keys = {kind: rng.sample(names, len(names)) for kind, (names, _) in KINDS.items()}
    drafts: list[tuple[str, str, str, list[tuple[str, str]]]] = []  # sender, subject, body, questions
    for n in range(FACTS):
        kind = rng.choice(sorted(KINDS))
        fact = KINDS[kind][1](rng, keys[kind].pop(), owner)
        sender = rng.choice(people)
        drafts.append((sender, fact.subject, fact.body, fact.questions))
        if n < FOLLOW_UPS:  # the same meeting/order/trip named again, without its fact
            drafts.append((sender, *fact.follow_up, []))
    for subject, body in rng.sample(NEWSLETTERS, NEWSLETTERS_PER_INBOX):
        drafts.append((rng.choice(people), subject, body, []))
    rng.shuffle(drafts)
    ids = rng.sample(range(10000, 99999), len(drafts))
    emails, questions = [], []
    days = sorted(rng.sample(range(365), len(drafts)))
    for (sender, subject, body, asked), number, day in zip(drafts, ids, days):
        address = f"{sender.lower().replace(' ', '.')}@{rng.choice(COMPANIES)}"
        sent = date(2024, 1, 1) + timedelta(days=day)
        email = Email(f"M{number}", name, f"{sender} <{address}>", sent.isoformat(), subject, body)
        emails.append(email)
        if asked:
            question, answer = rng.choice(asked)
            questions.append(Question(name, email.message_id, question, answer))
    return emails, questions


def inbox_names(split: str) -> list[str]:
    """Training and held-out inboxes are different inboxes, never shared between the splits."""
    return [f"{split}-{n}" for n in range(40 if split == "train" else 16)]


@functools.cache
def database() -> Path:
    """Build the database of every inbox once per process, into a temporary file."""
    handle, name = tempfile.mkstemp(prefix="email-search-", suffix=".sqlite")
    os.close(handle)
    path = Path(name)
    atexit.register(path.unlink, missing_ok=True)
    with closing(sqlite3.connect(path)) as db, db:  # closed after the transaction commits
        db.execute("CREATE TABLE emails (message_id TEXT, inbox TEXT, sender TEXT, date TEXT, subject TEXT, body TEXT,"
                   " PRIMARY KEY (inbox, message_id))")
        # The full-text index covers what a person searches by; bm25 ranks subject matches higher.
        db.execute("CREATE VIRTUAL TABLE emails_fts USING fts5(subject, body, sender, inbox UNINDEXED,"
                   " message_id UNINDEXED, tokenize='porter unicode61')")
        for split in ("train", "val"):
            for inbox in inbox_names(split):
                emails, _ = generate_inbox(inbox)
                db.executemany("INSERT INTO emails VALUES (?, ?, ?, ?, ?, ?)",
                               [(e.message_id, e.inbox, e.sender, e.date, e.subject, e.body) for e in emails])
                db.executemany("INSERT INTO emails_fts VALUES (?, ?, ?, ?, ?)",
                               [(e.subject, e.body, e.sender, e.inbox, e.message_id) for e in emails])
    return path


@contextmanager
def connect() -> Iterator[sqlite3.Connection]:
    """One read-only connection per query: tools run on any thread."""
    db = sqlite3.connect(f"file:{database()}?mode=ro", uri=True)
    try:
        yield db
    finally:
        db.close()


@dataclass(frozen=True)
class SearchHit:
    message_id: str
    subject: str
    snippet: str


def search(inbox: str, keywords: str, max_results: int = 3) -> list[SearchHit]:
    """Emails of `inbox` matching any of the words in `keywords`, best match first (bm25).

    Any word may match, not all of them: a small model's keywords carry stray words, and
    ranking still puts the email that matches the distinctive ones first."""
    words = sorted(set(re.findall(r"[^\W_]+", keywords.lower())))  # split as FTS5 splits
    if not words:
        return []
    query = " OR ".join(f'"{w}"' for w in words)
    with connect() as db:
        rows = db.execute("SELECT message_id, subject, snippet(emails_fts, 1, '', '', '...', 8) FROM emails_fts "
                          "WHERE emails_fts MATCH ? AND inbox = ? ORDER BY bm25(emails_fts, 2.0, 1.0, 0.5) LIMIT ?",
                          (query, inbox, max_results)).fetchall()
    return [SearchHit(*row) for row in rows]


def read(inbox: str, message_id: str) -> Email | None:
    with connect() as db:
        row = db.execute("SELECT message_id, inbox, sender, date, subject, body FROM emails "
                         "WHERE inbox = ? AND message_id = ?", (inbox, message_id.strip())).fetchone()
    return Email(*row) if row else None
