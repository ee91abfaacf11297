"""Chat prompts for a chat pair: a fixed held-out set for evaluation, and a larger training set
that never shares a source with it.

Five categories: writing (templates over a list of subjects), explanation (concepts, Python
standard-library modules and language topics), reasoning (arithmetic word problems drawn from a
seeded generator), coding (tasks over the Python standard library, read from its sources), and
extraction (summaries and extractions over local text: standard-library docstrings and
/usr/share/doc). Every prompt has a source key; a hash of the key puts it on the held-out side or
the training side, so the two sets share no subject, module, document or generated problem.
The held-out set is committed (smollm2-heldout.jsonl): local documents differ from machine to
machine, and the training set built on another machine is checked against the committed file.
"""

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("writing", "explanation", "reasoning", "coding", "extraction")
HELDOUT_FILE = Path(__file__).resolve().parent / "smollm2-heldout.jsonl"
HELDOUT_PER_CATEGORY = 16
# One source key in HELDOUT_SHARE goes to the held-out side.
HELDOUT_SHARE = 8
DOC_ROOT = Path("/usr/share/doc")
STDLIB = Path(os.__file__).resolve().parent
# Standard-library folders that are tools, tests or platform glue rather than library modules.
STDLIB_SKIP = {"idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "distutils", "test",
               "tests", "pydoc_data", "encodings", "venv", "site-packages", "config",
               "antigravity", "this", "__phello__", "ntpath", "nturl2path", "genericpath",
               "sre_compile", "sre_constants", "sre_parse", "opcode", "pydoc", "turtle"}
# Deprecated modules, gone from newer Pythons (PEP 594, distutils, imp, asyncore/asynchat).
STDLIB_SKIP |= {"aifc", "asynchat", "asyncore", "audioop", "cgi", "cgitb", "chunk", "crypt",
                "imghdr", "imp", "mailcap", "msilib", "nis", "nntplib", "ossaudiodev", "pipes",
                "smtpd", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib"}
PASSAGE_CHARS = (250, 600)
# Documents read per /usr/share/doc/<package> (git alone ships hundreds of release notes).
DOCS_PER_PACKAGE = 6
REASONING_CANDIDATES = 6000


@dataclass(frozen=True)
class Candidate:
    """A user prompt of a category, and the source key that decides its side of the split."""

    category: str
    key: str
    content: str

    def record(self) -> dict:
        return {"category": self.category, "source": self.key,
                "messages": [{"role": "user", "content": self.content}]}


def is_heldout(key: str) -> bool:
    """Whether a source key belongs to the held-out side (a hash, the same on every machine)."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % HELDOUT_SHARE == 0


# -- writing ---------------------------------------------------------------------------------

SUBJECTS = (
    "a lighthouse keeper", "autumn leaves", "a lost umbrella", "the first day of school",
    "a thunderstorm over the city", "a broken bicycle", "a cat that hates Mondays",
    "a tiny robot", "an old map", "the smell of fresh bread", "a train station at midnight",
    "a forgotten birthday", "a garden in winter", "a retired astronaut", "a library book",
    "the last slice of pizza", "a mountain village", "a street musician", "a rainy Sunday",
    "a kite on a windy day", "a grandmother's recipe", "a chess tournament", "a night market",
    "a snowman", "a lonely whale", "a new pair of shoes", "the ocean at dawn", "a power outage",
    "a secret door", "a small bakery", "a football match", "a time traveller", "a sunflower",
    "a school science fair", "an abandoned factory", "a hot air balloon", "a dog's first walk",
    "a moving day", "a quiet forest", "a video game tournament", "a bus driver",
    "the moon landing", "a paper airplane", "a coffee shop", "a desert island", "an old piano",
    "a wedding speech", "a spelling bee", "a volcano", "a firefly", "a family road trip",
    "a farmer's market", "a friendly ghost", "a busy hospital", "a lost key", "a city park",
    "an ant colony", "a music festival", "a clock that runs backwards", "a polar bear",
    "a job interview", "a treehouse", "a long-distance friendship", "a bicycle race",
    "a snow day", "an art museum", "a dragon who is afraid of fire", "a fishing boat",
    "a summer camp", "a broken phone", "a message in a bottle", "a harvest festival",
    "a beekeeper", "a rainbow", "an empty stadium", "the first snowfall", "a city at night",
    "a haunted lighthouse", "a tea ceremony", "a marathon runner", "a new neighbour",
    "a carnival", "a shooting star", "an old photograph", "a village well", "a cooking contest",
    "a museum guard", "a parrot that talks too much", "a rooftop garden", "a sandcastle",
    "a thunderstorm at sea", "a mail carrier", "a puzzle with a missing piece", "a hedgehog",
    "the smell of rain", "a subway ride", "a vegetable patch", "an inventor's workshop",
    "a snow globe", "a mountain hike", "a birthday cake", "a family dinner",
    "a robot learning to paint", "a penguin on holiday", "a stormy night", "an apple orchard",
    "a secret recipe", "a river crossing", "a typewriter", "a lantern festival",
    "a violin lesson", "the end of summer", "a street food stall", "a sleepy town",
    "a runaway balloon", "a starry sky", "a bookshop cat", "a spaceship repair crew",
    "a homemade radio", "a tortoise and a hare rematch", "the first day at a new job",
)
FORMS = (
    "a haiku about {s}", "a four-line rhyming poem about {s}", "a limerick about {s}",
    "a short story about {s}", "a product description inspired by {s}",
    "a persuasive paragraph about why {s} deserves more attention",
    "a diary entry by someone who encounters {s}", "the opening of a speech about {s}",
    "a friendly email to a colleague that mentions {s}",
    "a news headline and first paragraph about {s}", "a riddle whose answer is {s}",
    "a two-sentence story about {s}", "a short motivational note inspired by {s}",
    "a bedtime story for a child about {s}", "a short dialogue between two friends about {s}",
    "a postcard message describing {s}", "a short song chorus about {s}",
    "a one-paragraph description of {s} that uses all five senses",
)
TONES = ("", " Keep it cheerful.", " Use a formal tone.", " Make it funny.",
         " Write it for a ten-year-old.", " Use simple words.", " Make it a little sad.",
         " Keep it under 80 words.")


def writing_candidates() -> list[Candidate]:
    """Every form and tone over every subject."""
    return [Candidate("writing", f"writing:{s}", f"Write {form.format(s=s)}.{tone}")
            for s in SUBJECTS for form in FORMS for tone in TONES]


# -- explanation -----------------------------------------------------------------------------

CONCEPTS = (
    "photosynthesis", "how vaccines work", "compound interest", "the water cycle",
    "why the sky is blue", "inflation", "a hash table", "recursion", "plate tectonics",
    "supply and demand", "how a refrigerator works", "black holes", "the greenhouse effect",
    "how the internet routes data", "natural selection",
    "the difference between weather and climate", "how a bill becomes a law", "opportunity cost", "the immune system",
    "how batteries store energy", "binary numbers", "encryption", "the placebo effect",
    "how airplanes fly", "the seasons", "tides", "how a compiler works", "DNA",
    "the stock market", "electric circuits", "the scientific method", "probability",
    "how rainbows form", "a budget", "how muscles grow", "sleep cycles", "the food chain",
    "gravity", "how sound travels", "solar panels", "a credit score", "version control",
    "how search engines rank pages", "the Pythagorean theorem", "how bread rises",
    "how GPS works", "the circulatory system", "renewable energy", "how a loan works",
    "a virus versus bacteria", "the Roman Empire's fall", "how clouds form", "magnetism",
    "how a camera works", "the Doppler effect", "entropy", "how memory works in the brain",
    "a neural network", "statistics averages: mean, median and mode", "the printing press",
    "how earthquakes happen", "why leaves change colour", "the metric system",
    "how a democracy works", "the difference between speed and velocity", "friction",
    "how caching speeds up programs", "a database index", "how email is delivered",
    "the difference between a process and a thread", "how a thermostat works",
    "the nitrogen cycle", "how antibiotics work", "time zones", "leap years",
    "how a microwave oven heats food", "prime numbers", "the speed of light", "erosion",
    "how bees make honey", "the Industrial Revolution", "how a car engine works",
    "exchange rates", "taxes", "the phases of the Moon", "how maps represent the Earth",
    "a spreadsheet formula", "how a website is loaded in a browser", "sorting algorithms",
    "public and private keys", "how a river forms a delta", "insulation in houses",
    "the difference between RAM and storage", "recycling", "how a vaccine trial is run",
    "the tragedy of the commons", "how birds migrate", "how a lock and key work",
    "photosynthesis versus respiration", "how interest rates affect borrowing",
    "the role of a central bank", "how a heat pump works", "why ice floats",
    "how fingerprints are unique", "the big bang", "how a touchscreen works",
    "open-source software", "unit testing", "the difference between a list and a tuple",
)
CONCEPT_FRAMINGS = (
    "Explain {c} in simple terms.", "What is {c}? Give one everyday example.",
    "Explain {c} to a high-school student in three short paragraphs.",
    "Give a one-paragraph explanation of {c} and one common misconception about it.",
    "How would you explain {c} using an everyday analogy?",
    "What are the key ideas behind {c}? Answer with a short list.",
    "Why does {c} matter in daily life?", "Describe {c} step by step.",
)
MODULE_FRAMINGS = (
    ("What is the Python standard-library module `{m}` for? Give a short example of when to "
     "use it."),
    "The Python module `{m}` is described as: \"{d}\" Explain in plain words what it does.",
    "When would a Python programmer reach for the `{m}` module? Name two typical tasks.",
)
TOPIC_FRAMINGS = (
    "Explain the Python language topic \"{t}\" to a beginner, with a small example.",
    "What should a Python programmer know about \"{t}\"? Keep it short.",
)


def explanation_candidates(modules: dict[str, str]) -> list[Candidate]:
    """Concepts, standard-library modules (name -> docstring summary) and language topics."""
    out = [Candidate("explanation", f"explain:{c}", f.format(c=c))
           for c in CONCEPTS for f in CONCEPT_FRAMINGS]
    out += [Candidate("explanation", f"module:{m}", f.format(m=m, d=d))
            for m, d in modules.items() for f in MODULE_FRAMINGS]
    out += [Candidate("explanation", f"topic:{t}", f.format(t=t))
            for t in language_topics() for f in TOPIC_FRAMINGS]
    return out


def language_topics() -> list[str]:
    """The topic names of the Python reference (pydoc_data.topics), in a readable form."""
    from pydoc_data.topics import topics

    return sorted({re.sub(r"[-_]", " ", name) for name in topics if len(name) > 2})


# -- reasoning -------------------------------------------------------------------------------

NAMES = ("Ana", "Ben", "Chloe", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kemi", "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara",
         "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe", "Aiko", "Bruno", "Carmen", "Dev")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
ITEMS = (("notebooks", "pens"), ("apples", "oranges"), ("tickets", "programmes"),
         ("stamps", "envelopes"), ("cupcakes", "cookies"), ("bolts", "nuts"),
         ("plants", "pots"), ("shirts", "socks"))
REASONING_SUFFIXES = ("", " Show your reasoning step by step.", " Explain your steps briefly.",
                      " Give the final answer on its own line.")


def _shopping(r: random.Random) -> str:
    name, (a, b) = r.choice(NAMES), r.choice(ITEMS)
    n, m, p, q = r.randint(2, 9), r.randint(2, 9), r.randint(2, 15), r.randint(1, 6)
    bill = ((n * p + m * q) // 10 + 1 + r.randint(0, 3)) * 10
    return (f"{name} buys {n} {a} at ${p} each and {m} {b} at ${q} each, and pays with "
            f"${bill}. How much change does {name} get?")


def _trip(r: random.Random) -> str:
    d1, v1, d2, v2 = r.randint(2, 30) * 10, r.choice((40, 50, 60, 80)), r.randint(1, 20) * 10, \
        r.choice((30, 45, 60, 90))
    return (f"A train travels {d1} km at {v1} km/h, then {d2} km at {v2} km/h. How long does "
            "the whole trip take, in hours and minutes?")


def _sharing(r: random.Random) -> str:
    name, n, k = r.choice(NAMES), r.randint(20, 200), r.randint(3, 9)
    thing = r.choice(("stickers", "marbles", "sweets", "cards", "coins"))
    return (f"{name} has {n} {thing} and shares them equally among {k} friends, keeping any "
            "that are left over. How many does each friend get, and how many are left?")


def _ages(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    young, gap, years = r.randint(3, 30), r.randint(2, 25), r.randint(2, 15)
    total = 2 * young + gap + 2 * years
    return (f"{a} is {gap} years older than {b}. In {years} years the sum of their ages will be "
            f"{total}. How old is {b} now?")


def _discount(r: random.Random) -> str:
    item = r.choice(("jacket", "lamp", "bicycle", "backpack", "printer", "kettle"))
    price, off, tax = r.randint(20, 400), r.choice((10, 15, 20, 25, 30, 40)), r.choice((5, 8, 10))
    return (f"A {item} costs ${price}. It is discounted by {off}%, and then a {tax}% sales tax "
            "is added. What is the final price?")


def _work(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    job = r.choice(("paint a fence", "clean the hall", "fill the pool", "pick the apples"))
    x, y = r.randint(2, 12), r.randint(2, 12)
    return f"{a} can {job} in {x} hours and {b} can do it in {y} hours. How long do they take together?"


def _weekday(r: random.Random) -> str:
    return (f"If today is {r.choice(WEEKDAYS)}, what day of the week will it be in "
            f"{r.randint(10, 500)} days?")


def _recipe(r: random.Random) -> str:
    serves, grams, people = r.choice((2, 4, 6, 8)), r.randint(10, 60) * 10, r.randint(3, 20)
    what = r.choice(("flour", "sugar", "rice", "butter", "oats"))
    return (f"A recipe for {serves} people needs {grams} grams of {what}. How much {what} is "
            f"needed for {people} people?")


def _savings(r: random.Random) -> str:
    name, weekly, has = r.choice(NAMES), r.randint(5, 40), r.randint(0, 100)
    goal = has + weekly * r.randint(3, 30) + r.randint(1, weekly)
    thing = r.choice(("bike", "guitar", "tablet", "tent", "telescope"))
    return (f"{name} saves ${weekly} every week and already has ${has}. How many weeks until "
            f"{name} can buy a ${goal} {thing}?")


def _path_area(r: random.Random) -> str:
    w, length, p = r.randint(3, 20), r.randint(4, 30), r.choice((1, 2, 3))
    return (f"A rectangular garden is {w} m by {length} m. A path {p} m wide runs around the "
            "outside of it. What is the area of the path?")


def _fuel(r: random.Random) -> str:
    use, cost, km = r.randint(4, 12), r.randint(12, 25) / 10, r.randint(5, 90) * 10
    return (f"A car uses {use} litres of fuel per 100 km, and fuel costs ${cost:.2f} per litre. "
            f"How much does the fuel for a {km} km trip cost?")


def _clock(r: random.Random) -> str:
    h, m, mins = r.randint(9, 22), r.choice(range(0, 60, 5)), r.randint(70, 200)
    what = r.choice(("A film", "A concert", "A football match", "A lecture"))
    return f"{what} starts at {h:02d}:{m:02d} and lasts {mins} minutes. At what time does it end?"


def _sequence(r: random.Random) -> str:
    if r.random() < 0.5:
        start, step = r.randint(1, 50), r.randint(2, 15)
        terms = [start + i * step for i in range(5)]
    else:
        start, ratio = r.randint(1, 5), r.choice((2, 3))
        terms = [start * ratio**i for i in range(5)]
    return f"What is the next number in the sequence {', '.join(map(str, terms))}? Explain the pattern."


def _average(r: random.Random) -> str:
    name, scores = r.choice(NAMES), [r.randint(55, 98) for _ in range(r.randint(3, 5))]
    target = round(sum(scores) / len(scores)) + r.randint(1, 6)
    return (f"{name}'s test scores so far are {', '.join(map(str, scores))}. What score does "
            f"{name} need on the next test to reach an average of {target}?")


REASONING_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping, _trip, _sharing, _ages, _discount, _work, _weekday, _recipe, _savings,
    _path_area, _fuel, _clock, _sequence, _average,
)


def reasoning_candidates(seed: int = 0) -> list[Candidate]:
    """Word problems from the templates with seeded numbers; each problem is its own key,
    prefixed by its template's name."""
    r, seen, out = random.Random(seed), set(), []
    for _ in range(REASONING_CANDIDATES):
        template = r.choice(REASONING_TEMPLATES)
        problem = template(r)
        if problem not in seen:
            seen.add(problem)
            out.append(Candidate("reasoning", f"{template.__name__.lstrip('_')}:{problem}",
                                 problem + r.choice(REASONING_SUFFIXES)))
    return out


# -- coding ----------------------------------------------------------------------------------

CODING_TASKS = (
    "checks whether a string is a palindrome, ignoring case, spaces and punctuation",
    "counts how often each word appears in a text and returns the five most common",
    "merges two sorted lists into one sorted list without using sort()",
    "returns the n-th Fibonacci number iteratively",
    "flattens a nested list of any depth",
    "removes duplicates from a list while keeping the original order",
    "converts a Roman numeral to an integer",
    "checks whether two strings are anagrams",
    "groups a list of words by their first letter into a dictionary",
    "computes the running average of a list of numbers",
    "finds the longest common prefix of a list of strings",
    "validates that brackets in a string are balanced",
    "splits a list into chunks of a given size",
    "returns all prime numbers below n with the sieve of Eratosthenes",
    "converts a temperature table from Celsius to Fahrenheit",
    "transposes a matrix given as a list of lists",
    "finds the second largest number in a list",
    "reverses the order of words in a sentence",
    "counts the vowels in a string",
    "rotates a list by k positions",
    "computes the greatest common divisor of two numbers with Euclid's algorithm",
    "parses a 'key=value; key=value' string into a dictionary",
    "returns the median of a list of numbers",
    "formats a number of seconds as hours, minutes and seconds",
    "checks whether a year is a leap year",
    "finds all pairs in a list that add up to a target sum",
    "implements binary search on a sorted list",
    "capitalises the first letter of every sentence in a paragraph",
    "computes the Levenshtein distance between two strings",
    "converts an integer to its binary representation without bin()",
    "returns the characters that appear in both of two strings",
    "compresses a string with run-length encoding",
    "decodes a run-length encoded string",
    "checks whether a number is a perfect square without floating point",
    "generates all permutations of a short string recursively",
    "finds the most frequent element of a list",
    "sums the digits of an integer",
    "validates a simple email address format",
    "reads a CSV file and returns the total of one numeric column",
    "implements a stack class with push, pop and peek",
    "implements a queue with two stacks",
    "returns the intersection of two lists without duplicates",
    "checks whether a list is sorted",
    "counts the lines, words and characters of a text file",
    "finds the longest word in a sentence",
    "converts a snake_case name to camelCase",
    "wraps a long paragraph to a given line width",
    "returns a dictionary sorted by its values",
    "computes the factorial of n recursively and iteratively",
    "finds missing numbers in a list that should contain 1 to n",
)
CODING_EXTRAS = ("", " Include a docstring and type hints.", " Add two short test cases.",
                 " Then explain its time complexity.", " Keep it under 15 lines.",
                 " Explain how it works in two sentences.")
API_FRAMINGS = (
    "Write a short Python example that uses `{f}` and explain what it prints.",
    ("Show how to use `{f}` from the Python standard library in a small function with type "
     "hints."),
    "What does `{f}` do? Answer briefly, then give a small example.",
    ("Here is the first line of the documentation of `{f}`: \"{d}\" Write a small Python "
     "program that uses it."),
)


def coding_candidates(functions: dict[str, str]) -> list[Candidate]:
    """Self-contained tasks and uses of standard-library functions (name -> summary)."""
    out = [Candidate("coding", f"task:{t}", f"Write a Python program that {t}.{e}")
           for t in CODING_TASKS for e in CODING_EXTRAS]
    out += [Candidate("coding", f"api:{f}", framing.format(f=f, d=d))
            for f, d in functions.items() for framing in API_FRAMINGS]
    return out


# -- extraction ------------------------------------------------------------------------------

EXTRACTION_TASKS = (
    "Summarise the following text in two sentences.",
    "List the three most important points of the following text as bullet points.",
    ("Extract every program, command, file name or option mentioned in the following text, "
     "as a list."),
    "What is the main purpose of the following text? Answer in one sentence.",
    "Write a short, descriptive title for the following text.",
    "Extract all names, dates and version numbers from the following text.",
    "Rewrite the following text in plain language for a beginner.",
    "Write three questions that the following text answers, each with its answer.",
)


def stdlib_sources() -> list[tuple[str, Path]]:
    """(module name, file) of the standard library's public modules, in a fixed order."""
    found = []
    for path in sorted(STDLIB.glob("*.py")) + sorted(STDLIB.glob("*/*.py")):
        parts = path.relative_to(STDLIB).with_suffix("").parts
        if any(p.startswith("_") and p != "__init__" for p in parts) or parts[0] in STDLIB_SKIP:
            continue
        name = ".".join(p for p in parts if p != "__init__")
        found.append((name, path))
    return found


def summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def declared_all(tree: ast.Module) -> set[str] | None:
    """The names of a module's literal `__all__`, None without one."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return None


def stdlib_docs() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Module summaries, public function summaries, and longer docstrings (extraction
    passages) of the standard library, by qualified name."""
    import warnings

    modules, functions, passages = {}, {}, {}
    for name, path in stdlib_sources():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree)
        if doc and 20 <= len(summary(doc)) <= 200:
            modules[name] = summary(doc)
        if doc:
            passages[name] = doc
        exported = declared_all(tree)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                node_doc = ast.get_docstring(node)
                if not node_doc:
                    continue
                if (isinstance(node, ast.FunctionDef) and 15 <= len(summary(node_doc)) <= 160
                        and (exported is None or node.name in exported)):
                    functions[f"{name}.{node.name}"] = summary(node_doc)
                passages[f"{name}.{node.name}"] = node_doc
    return modules, functions, passages


def doc_files(root: Path = DOC_ROOT) -> Iterator[tuple[str, str]]:
    """(path, text) of the prose documents under root (README, NEWS, Markdown, ...; not
    changelogs, mostly names and addresses), each text once however many packages ship it."""
    if not root.is_dir():
        return
    prose = re.compile(r"^(readme|news|todo|faq|bugs|notes|usage|install)|"
                       r"\.(md|txt|rst|markdown)$", re.IGNORECASE)
    seen: set[str] = set()
    per_package: dict[str, int] = {}
    for path in sorted(root.rglob("*")):
        name = path.name.removesuffix(".gz")
        package = path.relative_to(root).parts[0]
        if (not prose.search(name) or "copyright" in name.lower() or path.is_symlink()
                or not path.is_file() or path.stat().st_size > 400_000
                or per_package.get(package, 0) >= DOCS_PER_PACKAGE):
            continue
        try:
            data = path.read_bytes()
            text = (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            per_package[package] = per_package.get(package, 0) + 1
            yield str(path), text


def passages_of(text: str, limit: int) -> list[str]:
    """Up to limit chunks of whole paragraphs, PASSAGE_CHARS long, mostly prose."""
    low, high = PASSAGE_CHARS
    chunks, current = [], ""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = "\n".join(line.rstrip() for line in paragraph.strip("\n").splitlines())
        if not paragraph.strip():
            continue
        joined = f"{current}\n\n{paragraph}" if current else paragraph
        if len(joined) <= high:
            current = joined
            continue
        if low <= len(current):
            chunks.append(current)
        current = paragraph if len(paragraph) <= high else ""
        if len(chunks) >= limit:
            break
    if low <= len(current) <= high and len(chunks) < limit:
        chunks.append(current)
    return [c for c in chunks if is_prose(c)]


def is_prose(text: str) -> bool:
    """Printable text, mostly letters and spaces (not tables, code dumps or logs)."""
    if not all(ch.isprintable() or ch in "\n\t" for ch in text):
        return False
    return sum(ch.isalpha() or ch == " " for ch in text) / len(text) > 0.75


def extraction_candidates(passages: dict[str, str], docs: list[tuple[str, str]]
                          ) -> list[Candidate]:
    """Tasks over docstring passages and local documents; the key of a document is its text's
    hash, so copies in several places land on one side."""
    sources = [(f"doc:{hashlib.sha1(text.encode()).hexdigest()[:16]}", text, 3)
               for _, text in docs]
    sources += [(f"docstring:{name}", doc, 2) for name, doc in passages.items()]
    out, n = [], len(EXTRACTION_TASKS)
    for key, text, limit in sources:
        first = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
        for i, passage in enumerate(passages_of(text, limit)):
            for task in (EXTRACTION_TASKS[(first + i) % n], EXTRACTION_TASKS[(first + i + 3) % n]):
                out.append(Candidate("extraction", key, f"{task}\n\n\"\"\"\n{passage}\n\"\"\""))
    return out


# -- the two sets ----------------------------------------------------------------------------


def candidates(seed: int = 0) -> dict[str, list[Candidate]]:
    """Every candidate prompt by category, in a fixed order for a given machine."""
    modules, functions, passages = stdlib_docs()
    return {
        "writing": writing_candidates(),
        "explanation": explanation_candidates(modules),
        "reasoning": reasoning_candidates(seed),
        "coding": coding_candidates(functions),
        "extraction": extraction_candidates(passages, list(doc_files())),
    }


def round_robin(lists: list[list[Candidate]]) -> list[Candidate]:
    """The first of each list, then the second of each, and so on."""
    longest = max((len(x) for x in lists), default=0)
    return [x[i] for i in range(longest) for x in lists if i < len(x)]


def pick(pool: list[Candidate], count: int, r: random.Random) -> list[Candidate]:
    """count candidates of distinct content, spread evenly over the kinds of source (the key's
    prefix: concept, module, task, ...) and, within a kind, over the keys."""
    by_key: dict[str, list[Candidate]] = {}
    for c in pool:
        by_key.setdefault(c.key, []).append(c)
    kinds: dict[str, list[list[Candidate]]] = {}
    for key in sorted(by_key):
        options = by_key[key]
        r.shuffle(options)
        kinds.setdefault(key.split(":")[0], []).append(options)
    for lists in kinds.values():
        r.shuffle(lists)
    order = round_robin([round_robin(kinds[k]) for k in sorted(kinds)])
    chosen, seen = [], set()
    for c in order:
        if c.content not in seen:
            seen.add(c.content)
            chosen.append(c)
            if len(chosen) == count:
                break
    return chosen


def heldout_prompts(per_category: int = HELDOUT_PER_CATEGORY, seed: int = 0) -> list[dict]:
    """The held-out set as built on this machine (the committed one is HELDOUT_FILE)."""
    r = random.Random(seed)
    out = []
    for pool in candidates(seed).values():
        side = [c for c in pool if is_heldout(c.key)]
        out += [c.record() for c in pick(side, per_category, r)]
    return out


def load_heldout(path: str | Path | None = None) -> list[dict]:
    """The held-out records (default: the committed HELDOUT_FILE)."""
    text = Path(path or HELDOUT_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def content(record: dict) -> str:
    """The user message of a prompt record."""
    return record["messages"][-1]["content"]


def training_prompts(count: int = 4000, seed: int = 0,
                     heldout_file: str | Path | None = None) -> list[dict]:
    """count training prompts, spread evenly over the categories; no source key or content of
    the held-out set (default: the committed one) among them."""
    heldout = load_heldout(heldout_file)
    held_contents = {content(h) for h in heldout}
    held_keys = {h["source"] for h in heldout}
    r = random.Random(seed + 1)
    pools = candidates(seed)
    out = []
    for i, (category, pool) in enumerate(pools.items()):
        share = count // len(pools) + (i < count % len(pools))
        side = [c for c in pool if not is_heldout(c.key) and c.key not in held_keys
                and c.content not in held_contents]
        out += [c.record() for c in pick(side, share, r)]
    r.shuffle(out)
    assert not held_contents & {content(p) for p in out}, "training prompts overlap held-out"
    assert not held_keys & {p["source"] for p in out}, "training sources overlap held-out"
    return out


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """records as JSON lines in path; returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m vllm_dflash.pairs.prompts {train,heldout} OUT`: write a prompt set."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("train", "heldout"))
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--count", type=int, default=4000, help="training prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.which == "train":
        records = training_prompts(args.count, args.seed)
    else:
        records = heldout_prompts(seed=args.seed)
    print(f"{len(records)} prompts -> {write_jsonl(records, args.out)}")


if __name__ == "__main__":
    main()
