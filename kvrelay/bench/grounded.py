"""Sources of the `grounded` prompt set: original passages and Python files, with the tasks asked
about them.

Every answer to these tasks copies long spans of its input (a summary reuses the passage's
phrases, a rewrite most of its words, a code edit nearly all of the file), which is what
prompt-lookup (n-gram) speculative decoding drafts from. All texts were written for kvrelay.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("summarize", "rewrite", "code-edit")  # one request in three of each, in this order

SUMMARIZE = [
    "Summarize the following passage in three sentences.",
    "Write a one-paragraph summary of the text below. Keep its names and numbers.",
    "Summarize the passage below as a short bulleted list of its main points.",
    "In a few sentences, summarize what the text below says, using its own wording where possible.",
]
REWRITE = [
    "Rewrite the following passage in the past tense. Change nothing else and return the whole "
    "passage.",
    "Rewrite the passage below in a more formal register. Keep every fact and the paragraph order.",
    "Fix any grammar, spelling or punctuation mistakes in the text below and return the full "
    "corrected text.",
    "Rewrite the text below in the first person, as if the person it describes were telling it. "
    "Keep every detail.",
]


@dataclass(frozen=True, slots=True)
class CodeSource:
    """A Python file and edits that fit it (each asks for the whole file back)."""

    name: str
    code: str
    edits: tuple[str, ...]


PASSAGES = [
    (
        "the lighthouse keeper",
        """Marta Velin takes over the lighthouse on Grey Point at the start of every November. \
The station sits on a ridge of black rock four kilometres from the nearest village, and the only \
road to it floods twice a day when the tide comes in. She carries her supplies across at low \
water: flour, lamp oil for the backup lantern, batteries, and a crate of books that she swaps \
with the village school each spring.

The main light has been electric since 1987, so her work is mostly inspection. Each evening she \
climbs the ninety-two steps of the tower, cleans the salt from the outer glass, and checks that \
the lamp turns once every twelve seconds. Each morning she writes the wind speed, the visibility \
and the state of the sea in a logbook that the harbour office collects on the first day of the \
month.

The hardest weeks are in January, when storms can cut the station off for six or seven days. \
During the storm of 2019 the power line from the village failed, and Marta ran the light on the \
generator for fifty hours without sleeping for more than an hour at a time. The harbour office \
later counted eleven fishing boats that came home safely that week.

She says the silence is the part that visitors never understand. There is no traffic, no \
television and often no telephone signal, only the sound of the water and the click of the \
lamp's motor above her head. In April, when the relief keeper arrives, she walks back across the \
causeway and spends the first night in the village unable to sleep because of the noise.""",
    ),
    (
        "the community orchard",
        """Three years ago the town council of Elsford agreed to let residents plant fruit \
trees on a strip of unused land beside the railway. The land had been a coal yard until the \
1960s, so the first task was to test the soil. The results showed high levels of lead near the \
old loading platform, and the volunteers decided to plant only in raised beds filled with clean \
earth brought in from a farm eight kilometres away.

Forty-six people joined the orchard group in the first season. They planted twenty apple trees, \
eight pears, six plums and a row of cherries along the fence, choosing old local varieties that \
a nursery in the next valley still grows. Each tree was adopted by a household, which agreed to \
water it through its first two summers and to report any signs of disease on a shared \
noticeboard.

The first real harvest came last autumn. The group picked about four hundred kilograms of \
apples, pressed half of them into juice at a borrowed press, and gave the rest to the school \
kitchen and the food bank. A small amount was sold at the market, and the money paid for new \
stakes and a second water tank.

Not everything has worked. Two of the cherry trees died after a dry spring, and a fungal disease \
spread through the pears in the second year before anyone noticed the spots on the leaves. The \
group now holds a walk around the orchard on the first Saturday of each month, when an \
experienced grower checks every tree and shows newer members what to look for.""",
    ),
    (
        "the night bus",
        """The number 40 night bus leaves the central station at a quarter past midnight and \
reaches the hospital at the edge of the city forty minutes later. For most of the year it \
carries between fifteen and thirty passengers: nurses going to the late shift, cleaners, \
students coming back from the library, and a few people who simply have nowhere else warm to \
be.

The driver on most nights is Tomas Reyes, who has worked the route for nine years. He knows many \
of his passengers by name and keeps a list of the stops where someone usually gets on, so that \
he can wait an extra minute if that person is late. The transport company does not officially \
allow this, but his timetable records show that the bus has never arrived at the hospital more \
than four minutes behind schedule.

Last winter the company proposed cutting the route to save money, arguing that the daytime \
buses carried ten times as many people for the same cost. The hospital staff union collected \
more than two thousand signatures against the plan in a single week, and several nurses spoke \
at the council meeting about walking home alone through the industrial district when the bus \
did not run.

The council kept the route but asked the company to collect better data. Since March, a counter \
on the door has recorded every passenger. The figures show that the busiest night is Thursday, \
that almost half of the riders travel to or from the hospital, and that the quietest stretch of \
the year is the first two weeks of August.""",
    ),
    (
        "the repair cafe",
        """On the second Sunday of every month the parish hall in Dunmore turns into a repair \
cafe. From ten in the morning until two in the afternoon, anyone can bring a broken object and \
sit with a volunteer who will try to fix it with them. Repairs are free, though there is a jar \
for donations and a table of cakes that the volunteers bake the night before.

The volunteers include a retired electrician, two sewing teachers, a bicycle mechanic and a \
teenager who is very good with phones. They keep a notebook of every repair, and over four years \
it has grown to more than three thousand entries. Toasters, lamps and vacuum cleaners are the \
most common electrical items, while trousers with broken zips are the most common clothing \
repair.

About seven in ten items leave the hall working again. The most common reason for a failed \
repair is a part that is no longer made, and the second is a product that was glued together so \
that it cannot be opened without breaking it. The volunteers now send a short report each year \
to the regional government, listing the brands whose products were hardest to repair.

The organisers say the cafe is only partly about saving money or reducing waste. Many visitors \
come back to learn how to do the next repair themselves, and some of the current volunteers \
first arrived carrying a broken radio. One of them, a former accountant named Greta Holm, now \
runs a monthly evening class on basic soldering in the same hall.""",
    ),
    (
        "the river survey",
        """Every June a team of volunteers walks the length of the Calder Brook, a small river \
that runs twenty-three kilometres from the moors to the estuary. They divide it into sections of \
five hundred metres and record what they find in each one: the width and depth of the water, \
the plants on the banks, any rubbish, and signs of animals such as otter tracks or the holes of \
water voles.

The survey began in 2009, when a local angling club noticed that fish numbers were falling. \
Their first report found that three farms upstream were letting cattle walk into the river to \
drink, which churned up the bed and washed soil downstream. With a grant from a conservation \
trust, the club and the farmers put up fences and installed drinking troughs fed by solar \
pumps.

The changes took years to show. By 2015 the water in the middle sections was noticeably clearer, \
and in 2018 the volunteers recorded trout spawning in gravel beds that had been covered in silt \
for as long as anyone could remember. Otters returned to the lower river two years later, and \
their tracks have been seen in every survey since.

The group now trains new volunteers each spring, using a short booklet and a day of practice on \
the easiest section near the village bridge. The data from all fourteen years is published \
online, and a student at the regional university is using it to study how quickly small rivers \
recover once the main source of damage is removed.""",
    ),
    (
        "the printing workshop",
        """In a narrow building behind the old market, Ines Okafor runs one of the last \
letterpress workshops in the region. She bought the first press, a cast-iron machine made in \
1924, from a closing newspaper for the price of transporting it. It took her two years of \
evenings to clean, repair and learn to use it, and she still keeps the notes she made during \
that time in a folder beside the type cases.

The workshop now holds four presses and about two hundred drawers of metal and wooden type. Most \
of the paid work is wedding invitations, business cards and posters for local theatres, printed \
in small runs of a few hundred copies. Each job is set by hand, one letter at a time, and a \
single poster can take a full day to prepare before the first sheet is printed.

On Wednesday afternoons the workshop is open to the public. Visitors can set their own name in \
type and print it on a card to take home, and school groups come to see how books were made \
before computers. Ines says that children are usually surprised that every letter has to be \
placed backwards, and that the spaces between words are pieces of metal too.

Keeping the presses running is the biggest challenge. Spare parts are no longer made, so she \
works with a machinist in the next town who copies broken pieces from the originals. Last year \
he made a new gear for the oldest press, and the machine printed its first job in eight months: \
a poster for the market's hundredth anniversary.""",
    ),
    (
        "the mountain hut",
        """The Kessler hut stands at two thousand four hundred metres, on the only route \
between the two valleys that does not require climbing equipment. It has forty beds in four \
rooms, a kitchen, a drying room for wet boots and a small radio room that connects it with the \
mountain rescue station below. The hut is open from the middle of June until the end of \
September, when the first heavy snow usually closes the path.

Everything the hut needs arrives by helicopter in two flights at the start of the season: gas, \
tinned food, flour, bedding and tools. Fresh vegetables, bread and milk are carried up once a \
week by a mule named Bruno, who has made the trip for eleven summers. Rubbish goes down the same \
way, and guests are asked to take their own waste back to the valley.

The warden, Lukas Brandt, and two assistants cook one meal each evening for everyone staying \
the night. Dinner is served at seven, and lights go out at ten. Guests who want to leave before \
sunrise for the summit can ask for a packed breakfast, which is left on a shelf by the door.

In recent years the glacier above the hut has retreated so far that the old path across it is \
no longer safe. A new path was built along the rocks on its eastern side, adding about forty \
minutes to the walk. Lukas keeps photographs of the glacier taken from the same window every \
August since 1998, and visitors often spend a long time looking at them after dinner.""",
    ),
    (
        "the school garden",
        """When Halden Primary School opened its garden six years ago, it was a patch of grass \
behind the sports hall that nobody used. The parents' association paid for eight raised beds, a \
shed and a water butt, and a retired gardener offered to help the teachers one morning a week. \
Each class was given one bed and asked to decide, by vote, what it would grow.

The youngest children usually choose sunflowers and strawberries, while older classes tend to \
pick vegetables they can cook. Last year the oldest class grew potatoes, onions and beans, then \
made soup for the whole school in the last week of the summer term. The recipe, written by the \
pupils, is now painted on a board beside the shed.

The garden is also used for lessons. Younger pupils measure how fast their bean plants grow and \
draw the results as charts, and older ones test the soil, count the insects in a square metre \
of the wildflower patch and write reports about what they find. Teachers say that pupils who \
find classroom work difficult are often the most careful and patient in the garden.

Keeping the garden alive during the summer holidays was a problem in the first two years, when \
most of the plants died in August. Now families sign up for one week each to water the beds and \
pick whatever is ripe, and they may keep what they pick. The list for the coming summer was full \
within two days of being put up on the school noticeboard.""",
    ),
]

CODE = [
    CodeSource(
        "inventory.py",
        """class Inventory:
    def __init__(self, name, items=None):
        self.name = name
        self.items = items or {}
        self.history = []

    def add(self, sku, qty):
        if qty <= 0:
            raise ValueError("quantity must be positive")
        self.items[sku] = self.items.get(sku, 0) + qty
        self.history.append(("add", sku, qty))

    def remove(self, sku, qty):
        have = self.items.get(sku, 0)
        if qty > have:
            raise ValueError(f"only {have} of {sku} in stock")
        self.items[sku] = have - qty
        if self.items[sku] == 0:
            del self.items[sku]
        self.history.append(("remove", sku, qty))

    def total(self):
        return sum(self.items.values())

    def low_stock(self, limit=5):
        return sorted(sku for sku, qty in self.items.items() if qty < limit)

    def undo(self):
        if not self.history:
            return False
        action, sku, qty = self.history.pop()
        if action == "add":
            self.items[sku] -= qty
            if self.items[sku] == 0:
                del self.items[sku]
        else:
            self.items[sku] = self.items.get(sku, 0) + qty
        return True


def merge(first, second):
    merged = Inventory(first.name + "+" + second.name, dict(first.items))
    for sku, qty in second.items.items():
        merged.add(sku, qty)
    return merged
""",
        (
            "Rename the variable `qty` to `quantity` everywhere and add type hints to every "
            "method and function. Return the whole file.",
            "Add a docstring to the class and to every method and function. Return the whole file.",
            "Make `remove` raise a `KeyError` when the SKU is not in stock at all, and keep the "
            "existing `ValueError` for too small a quantity. Return the whole file.",
        ),
    ),
    CodeSource(
        "csv_report.py",
        """import csv
from collections import defaultdict


def read_rows(path):
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            row["amount"] = float(row["amount"])
            rows.append(row)
    return rows


def totals_by_region(rows):
    totals = defaultdict(float)
    for row in rows:
        totals[row["region"]] += row["amount"]
    return dict(totals)


def top_customers(rows, n=3):
    spent = defaultdict(float)
    for row in rows:
        spent[row["customer"]] += row["amount"]
    ranked = sorted(spent.items(), key=lambda kv: kv[1], reverse=True)
    return ranked[:n]


def format_report(rows):
    lines = ["Sales report", "============", ""]
    for region, total in sorted(totals_by_region(rows).items()):
        lines.append(f"{region:<12} {total:>10.2f}")
    lines.append("")
    lines.append("Top customers:")
    for name, total in top_customers(rows):
        lines.append(f"  {name:<20} {total:>10.2f}")
    return "\\n".join(lines)


def main(path):
    rows = read_rows(path)
    if not rows:
        print("no data")
        return 1
    print(format_report(rows))
    return 0
""",
        (
            "Rename the variable `rows` to `records` everywhere and add type hints to every "
            "function. Return the whole file.",
            "Add a docstring to every function explaining its arguments and return value. Return "
            "the whole file.",
            "Change `top_customers` so that customers with equal totals are ordered by name, and "
            "make `main` print the number of rows read before the report. Return the whole file.",
        ),
    ),
    CodeSource(
        "thermostat.py",
        """class Thermostat:
    def __init__(self, target, tolerance=0.5, min_target=5.0, max_target=30.0):
        self.target = target
        self.tolerance = tolerance
        self.min_target = min_target
        self.max_target = max_target
        self.heating = False
        self.readings = []

    def set_target(self, value):
        if value < self.min_target or value > self.max_target:
            raise ValueError(f"target must be between {self.min_target} and {self.max_target}")
        self.target = value

    def record(self, temp):
        self.readings.append(temp)
        if len(self.readings) > 10:
            self.readings.pop(0)
        self.update(temp)

    def update(self, temp):
        if temp < self.target - self.tolerance:
            self.heating = True
        elif temp > self.target + self.tolerance:
            self.heating = False
        return self.heating

    def average(self):
        if not self.readings:
            return None
        return sum(self.readings) / len(self.readings)

    def status(self):
        avg = self.average()
        state = "on" if self.heating else "off"
        if avg is None:
            return f"heating {state}, no readings"
        return f"heating {state}, average {avg:.1f}, target {self.target:.1f}"
""",
        (
            "Convert `Thermostat` to a dataclass (the readings list needs a default factory) and "
            "keep every method as it is. Return the whole file.",
            "Rename the variable `temp` to `temperature` everywhere and add type hints to every "
            "method. Return the whole file.",
            "Add a docstring to the class and to every method. Return the whole file.",
        ),
    ),
    CodeSource(
        "text_stats.py",
        """import re
from collections import Counter

WORD = re.compile(r"[A-Za-z']+")
STOP_WORDS = {"the", "a", "an", "and", "or", "of", "to", "in", "is", "it", "that", "on"}


def words(text):
    return [w.lower() for w in WORD.findall(text)]


def sentences(text):
    parts = re.split(r"[.!?]+", text)
    return [p.strip() for p in parts if p.strip()]


def word_counts(text, skip_stop_words=True):
    counts = Counter(words(text))
    if skip_stop_words:
        for w in STOP_WORDS:
            counts.pop(w, None)
    return counts


def average_sentence_length(text):
    sents = sentences(text)
    if not sents:
        return 0.0
    return sum(len(words(s)) for s in sents) / len(sents)


def longest_words(text, n=5):
    unique = set(words(text))
    return sorted(unique, key=lambda w: (-len(w), w))[:n]


def summary(text):
    counts = word_counts(text)
    lines = [
        f"words: {len(words(text))}",
        f"sentences: {len(sentences(text))}",
        f"average sentence length: {average_sentence_length(text):.1f}",
        "most common: " + ", ".join(w for w, _ in counts.most_common(5)),
        "longest: " + ", ".join(longest_words(text)),
    ]
    return "\\n".join(lines)
""",
        (
            "Rename the variable `sents` to `sentence_list` and `counts` to `frequencies` "
            "everywhere, and add type hints to every function. Return the whole file.",
            "Add a docstring to every function, with a short usage example in each. Return the "
            "whole file.",
            "Add a function `unique_word_ratio(text)` after `longest_words` that returns the "
            "number of distinct words divided by the number of words (0.0 for empty text), and "
            "add it as a line of `summary`. Return the whole file.",
        ),
    ),
    CodeSource(
        "rate_limiter.py",
        """import time


class RateLimiter:
    def __init__(self, rate, burst, clock=time.monotonic):
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.last = clock()
        self.allowed = 0
        self.rejected = 0

    def refill(self):
        now = self.clock()
        elapsed = now - self.last
        self.last = now
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)

    def try_acquire(self, cost=1):
        self.refill()
        if cost > self.burst:
            raise ValueError("cost is larger than the burst size")
        if self.tokens >= cost:
            self.tokens -= cost
            self.allowed += 1
            return True
        self.rejected += 1
        return False

    def wait_time(self, cost=1):
        self.refill()
        missing = cost - self.tokens
        if missing <= 0:
            return 0.0
        return missing / self.rate

    def stats(self):
        total = self.allowed + self.rejected
        ratio = self.rejected / total if total else 0.0
        return {"allowed": self.allowed, "rejected": self.rejected, "reject_ratio": ratio}
""",
        (
            "Rename the variable `cost` to `amount` everywhere and add type hints to every "
            "method. Return the whole file.",
            "Add a docstring to the class and to every method, explaining the token bucket "
            "algorithm in the class docstring. Return the whole file.",
            "Add a method `acquire(self, cost=1)` that sleeps for `wait_time(cost)` and then "
            "calls `try_acquire(cost)` until it succeeds. Return the whole file.",
        ),
    ),
    CodeSource(
        "schedule.py",
        """from datetime import date, timedelta

WEEKDAYS = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]


class Shift:
    def __init__(self, person, day, start_hour, end_hour):
        if not 0 <= start_hour < end_hour <= 24:
            raise ValueError("bad shift hours")
        self.person = person
        self.day = day
        self.start_hour = start_hour
        self.end_hour = end_hour

    def hours(self):
        return self.end_hour - self.start_hour

    def overlaps(self, other):
        if self.day != other.day:
            return False
        return self.start_hour < other.end_hour and other.start_hour < self.end_hour


def week_of(start):
    monday = start - timedelta(days=start.weekday())
    return [monday + timedelta(days=i) for i in range(7)]


def hours_per_person(shifts):
    totals = {}
    for s in shifts:
        totals[s.person] = totals.get(s.person, 0) + s.hours()
    return totals


def conflicts(shifts):
    found = []
    for i, a in enumerate(shifts):
        for b in shifts[i + 1 :]:
            if a.person == b.person and a.overlaps(b):
                found.append((a, b))
    return found


def print_week(shifts, start=None):
    for day in week_of(start or date.today()):
        todays = [s for s in shifts if s.day == day]
        names = ", ".join(f"{s.person} {s.start_hour}-{s.end_hour}" for s in todays)
        print(f"{WEEKDAYS[day.weekday()]} {day.isoformat()}: {names or 'nobody'}")
""",
        (
            "Convert `Shift` to a dataclass, keeping the hour check in `__post_init__` and "
            "every method as it is. Return the whole file.",
            "Rename the variable `shifts` to `roster` everywhere and add type hints to every "
            "function and method. Return the whole file.",
            "Add a docstring to every class, method and function. Return the whole file.",
        ),
    ),
]
