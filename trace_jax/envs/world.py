"""Seeded procedural worlds for multi-hop search tasks: entities, functional relations and one document per entity.

A world is a small encyclopaedia: rivers, cities, universities, companies and people linked by functional relations
(``born_in``, ``works_for``, ``studied_at``, ``headquartered_in``, ``located_in``, ``on_river``) and attributes
(``population``, ``founded_year``, ``length_km``, ``birth_year``, ``profession``, ``industry``). Each entity has one
document ``{docid, url, title, text}`` stating its facts in varied sentence templates among distractor sentences.
Cities and rivers also list their residents (people born there, companies and universities based there, cities on
the river), so set-valued questions (counting, intersection) can be answered by reading pages.

Guarantees:
  * Same ``WorldConfig`` -> same world, byte for byte (``World.fingerprint()``); only ``random.Random(seed)`` with
    integer seeds is used, whose sequences Python keeps stable.
  * Entity names are unique strings; every non-person name is built on a word no other non-person entity uses.
  * All text (documents, and the questions built in ``tasks.py``) uses a closed vocabulary: ``vocabulary()`` lists
    every word that ``words(text)`` can produce, so a word-level tokenizer has no unknown tokens.

This module knows nothing about questions, search, tools or datasets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# ------------------------------------------------------------------------------------------------------------------
# Closed vocabulary pieces
# ------------------------------------------------------------------------------------------------------------------

# Names are two syllables from this fixed list ("Kalo", "Venmir"): 36 * 36 = 1296 name words, independent of seed.
SYLLABLES = (
    "ka", "lo", "mir", "ven", "ta", "dor", "si", "bel", "ru", "gan", "te", "ol", "mar", "ni", "vas", "ko",
    "ra", "len", "tu", "sha", "bo", "rin", "da", "fel", "pa", "zu", "hal", "ve", "mo", "kir", "ash", "lu",
    "gor", "ne", "tam", "sel",
)

ENTITY_TYPES = ("river", "city", "university", "company", "person")

PROFESSIONS = ("teacher", "lawyer", "doctor", "painter", "chemist", "farmer", "banker", "sailor", "writer",
               "nurse", "baker", "pilot")
PROFESSION_PLURALS = {p: p + "s" for p in PROFESSIONS}
INDUSTRIES = ("shipping", "textile", "mining", "publishing", "brewing", "banking", "software", "railway",
              "timber", "printing")
UNIVERSITY_SUFFIXES = ("University", "Institute", "College")
COMPANY_SUFFIXES = ("Holdings", "Works", "Group", "Trading", "Partners", "Company")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

# Relations: name -> (subject type, object type). All functional: one object per subject.
RELATIONS: dict[str, tuple[str, str]] = {
    "born_in": ("person", "city"),
    "works_for": ("person", "company"),
    "studied_at": ("person", "university"),
    "headquartered_in": ("company", "city"),
    "located_in": ("university", "city"),
    "on_river": ("city", "river"),
}
# Attributes: name -> (subject type, value kind).
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "population": ("city", "number"),
    "founded_year": ("city", "year"),
    "length_km": ("river", "number"),
    "birth_year": ("person", "year"),
    "profession": ("person", "word"),
    "industry": ("company", "word"),
    "university_founded_year": ("university", "year"),
    "company_founded_year": ("company", "year"),
}
# founded_year is shared by cities, universities and companies; the typed aliases above keep ATTRIBUTES functional.
FOUNDED_ATTRIBUTE = {"city": "founded_year", "university": "university_founded_year",
                     "company": "company_founded_year"}

# Fact sentences: each states exactly one fact, and contains the subject name ({s}) and value ({o}) verbatim.
FACT_TEMPLATES: dict[str, tuple[str, ...]] = {
    "born_in": ("{s} was born in {o}.", "{s} was born in the city of {o}.", "The birthplace of {s} is {o}.",
                "{s} is a native of {o}."),
    "works_for": ("{s} works for {o}.", "{s} is employed by {o}.", "Today {s} works at {o}.",
                  "The employer of {s} is {o}."),
    "studied_at": ("{s} studied at {o}.", "{s} graduated from {o}.", "{s} is a former student of {o}.",
                   "As a student, {s} attended {o}."),
    "headquartered_in": ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}.",
                         "{s} has its main offices in {o}.", "{s} is based in the city of {o}."),
    "located_in": ("{s} is located in {o}.", "The campus of {s} lies in {o}.", "{s} stands in the city of {o}.",
                   "{s} is based in {o}."),
    "on_river": ("{s} lies on the {o}.", "The {o} flows through {s}.", "{s} stands on the banks of the {o}.",
                 "{s} was built along the {o}."),
    "population": ("{s} has a population of {o}.", "The population of {s} is {o}.",
                   "{s} is home to {o} people.", "{o} people live in {s}."),
    "founded_year": ("{s} was founded in {o}.", "{s} was established in {o}.", "The city of {s} dates from {o}.",
                     "Settlers founded {s} in {o}."),
    "university_founded_year": ("{s} was founded in {o}.", "{s} was established in {o}.",
                                "{s} opened its doors in {o}.", "The first students came to {s} in {o}."),
    "company_founded_year": ("{s} was founded in {o}.", "{s} was established in {o}.",
                             "{s} began trading in {o}.", "The founders started {s} in {o}."),
    "length_km": ("The {s} is {o} kilometres long.", "The {s} has a length of {o} kilometres.",
                  "The {s} runs for {o} kilometres.", "The course of the {s} measures {o} kilometres."),
    "birth_year": ("{s} was born in the year {o}.", "{s} came into the world in {o}.",
                   "The year of birth of {s} is {o}.", "{s} was born in {o}."),
    "profession": ("{s} works as a {o}.", "{s} is a {o} by profession.", "By trade, {s} is a {o}.",
                   "{s} earns a living as a {o}."),
    "industry": ("{s} is a {o} company.", "{s} operates in the {o} industry.", "{s} does business in {o}.",
                 "The main trade of {s} is {o}."),
}
# List sentences on the page of the object ({s}) naming all subjects ({o} is a list "A, B and C").
LIST_TEMPLATES: dict[str, tuple[str, ...]] = {
    "born_in": ("People born in {s} include {o}.", "Notable natives of {s} are {o}."),
    "headquartered_in": ("Companies headquartered in {s} include {o}.", "{s} is the home of the companies {o}."),
    "located_in": ("Universities in {s} include {o}.", "{s} is home to {o}."),
    "on_river": ("Cities on the {s} include {o}.", "The {s} flows past the cities {o}."),
}
LIST_RELATION_FOR_TYPE = {"city": ("born_in", "headquartered_in", "located_in"), "river": ("on_river",)}
INTRO_TEMPLATES: dict[str, tuple[str, ...]] = {
    "river": ("The {s} is a river.", "The {s} is a long river in the region."),
    "city": ("{s} is a city.", "{s} is a city in the region."),
    "university": ("{s} is a university.", "{s} is a place of learning."),
    "company": ("{s} is a company.", "{s} is a business."),
    "person": ("{s} is a person of some note.", "This page is about {s}."),
}
NOUNS = ("markets", "gardens", "bridges", "music", "festivals", "libraries", "towers", "harbours", "museums",
         "bakeries", "archives", "parks", "songs", "painters", "boats", "stories")
ADJECTIVES = ("quiet", "busy", "old", "lively", "modest", "famous", "green", "windy", "proud", "curious")
FILLER_TEMPLATES = (
    "{s} is known for its {n}.",
    "Many visitors describe {s} as {a}.",
    "Old letters mention {s} and its {n}.",
    "Few records describe the early {n} of {s}.",
    "Some say that {s} is {a} in the spring.",
    "A local guide praises the {n} linked to {s}.",
    "Writers have called {s} {a} and {a2}.",
    "The {n} of {s} are often photographed.",
)
# Distractors mention other entities, years and numbers: they must never state a relation or attribute of {s}.
DISTRACTOR_TEMPLATES = (
    "{s} is often compared with {x}.",
    "A report from {y} mentions {s} and {x}.",
    "Travellers from {x} sometimes write about {s}.",
    "A plan to link {s} with {x} was never carried out.",
    "In {y}, a small exhibition about {x} was shown near {s}.",
    "A rival founded in {y} once tried to copy {s}.",
    "A ledger lists {k} visitors from {x} to {s}.",
)
NOISE_TITLE = "Travel notes {k}"
NOISE_TEMPLATES = (
    "The road from {x} to {x2} is {a}.",
    "A traveller passed through {x} and then {x2}.",
    "The {n} near {x} remind some of {x2}.",
    "Letters from {x} describe the {n}.",
)
URL_PREFIX = "https://wiki.local/"


def words(text: str) -> list[str]:
    """Split text into the word-level tokens the vocabulary covers: letter runs, single digits, single symbols.

    Digits are single tokens so that every number (years, populations, tool line numbers) is covered.
    """
    return re.findall(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]", text)


def name_words() -> tuple[str, ...]:
    """All 1296 two-syllable name words, in a fixed order independent of any seed."""
    return tuple((a + b).capitalize() for a in SYLLABLES for b in SYLLABLES)


def _template_words(templates: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for template in templates:
        found.update(words(re.sub(r"\{[a-z0-9]+\}", " ", template)))
    return found


def vocabulary(extra_texts: Iterable[str] = ()) -> list[str]:
    """The closed vocabulary of generated worlds and tasks: a sorted list of every token ``words()`` can yield.

    Includes both the lower-case and the capitalised form of every template word (sentence starts), all name words,
    digits and ASCII punctuation. ``extra_texts`` (e.g. the browser tools' fixed strings) are tokenised and added.
    """
    # Imported here to keep tasks.py free to import world.py.
    from trace_jax.envs import tasks as _tasks

    vocab: set[str] = set(name_words())
    template_texts = [t for group in FACT_TEMPLATES.values() for t in group]
    template_texts += [t for group in LIST_TEMPLATES.values() for t in group]
    template_texts += [t for group in INTRO_TEMPLATES.values() for t in group]
    template_texts += list(FILLER_TEMPLATES) + list(DISTRACTOR_TEMPLATES) + list(NOISE_TEMPLATES) + [NOISE_TITLE]
    template_texts += list(_tasks.QUESTION_TEXTS)
    plain = _template_words(template_texts)
    plain |= set(PROFESSIONS) | set(PROFESSION_PLURALS.values()) | set(INDUSTRIES) | set(NUMBER_WORDS)
    plain |= set(NOUNS) | set(ADJECTIVES) | set(UNIVERSITY_SUFFIXES) | set(COMPANY_SUFFIXES)
    plain |= {"River", "and", "https", "wiki", "local"} | set(ENTITY_TYPES) | {"noise"}
    for word in plain:
        vocab.add(word)
        if word.isalpha():
            vocab.add(word.lower())
            vocab.add(word.capitalize())
    vocab.update(string.digits)
    vocab.update(string.punctuation)
    for text in extra_texts:
        vocab.update(words(text))
    return sorted(vocab)


# ------------------------------------------------------------------------------------------------------------------
# Configuration and structures
# ------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorldConfig:
    """Knobs of a world. Same config -> same world, byte for byte.

    Attributes:
      seed: the world's random seed.
      num_people / num_cities / num_rivers / num_universities / num_companies: entity counts (one document each).
      distractors_per_doc: distractor sentences per document (they mention other entities, years and numbers).
      filler_per_doc: neutral filler sentences per document.
      deep_fact_prob: probability that a fact sentence is moved deep into the page, after ``deep_offset`` filler
        sentences, so it lies beyond the browser's first view and must be reached by scrolling or ``find``.
      deep_offset: number of filler sentences placed before deep facts.
      lookalike_rate: probability that a new name differs from an existing name of the same kind by one syllable.
      noise_docs: extra "travel notes" pages that mention many entity names (retrieval noise for BM25).
    """

    seed: int = 0
    num_people: int = 160
    num_cities: int = 40
    num_rivers: int = 12
    num_universities: int = 16
    num_companies: int = 48
    distractors_per_doc: int = 3
    filler_per_doc: int = 2
    deep_fact_prob: float = 0.2
    deep_offset: int = 48
    lookalike_rate: float = 0.2
    noise_docs: int = 20

    def __post_init__(self):
        counts = {f: getattr(self, f) for f in ("num_people", "num_cities", "num_rivers", "num_universities",
                                                 "num_companies")}
        for name, value in counts.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"WorldConfig.{name} must be a positive int, got {value!r}.")
        places = self.num_cities + self.num_rivers + self.num_universities + self.num_companies
        if places > len(SYLLABLES) ** 2 // 2:
            raise ValueError(
                f"WorldConfig: {places} cities+rivers+universities+companies exceed the {len(SYLLABLES) ** 2 // 2} "
                "place-name words; lower the counts (people may go up to about 100000).")
        if self.num_people > (len(SYLLABLES) ** 2 // 4) ** 2 // 2:
            raise ValueError(f"WorldConfig.num_people={self.num_people} is too large for the name pool.")
        for name in ("deep_fact_prob", "lookalike_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"WorldConfig.{name} must be in [0, 1], got {value!r}.")
        for name in ("distractors_per_doc", "filler_per_doc", "deep_offset", "noise_docs"):
            if getattr(self, name) < 0:
                raise ValueError(f"WorldConfig.{name} must be >= 0, got {getattr(self, name)!r}.")

    @classmethod
    def from_corpus_size(cls, num_docs: int, **knobs: Any) -> "WorldConfig":
        """Entity counts in fixed proportions for about ``num_docs`` entity documents (plus ``noise_docs``)."""
        if num_docs < 20:
            raise ValueError(f"from_corpus_size: num_docs must be >= 20, got {num_docs}.")
        non_people = min(int(num_docs * 0.45), len(SYLLABLES) ** 2 // 2)
        counts = dict(num_rivers=max(2, non_people * 12 // 116), num_cities=max(4, non_people * 40 // 116),
                      num_universities=max(2, non_people * 16 // 116))
        counts["num_companies"] = max(2, non_people - sum(counts.values()))
        counts["num_people"] = max(4, num_docs - sum(counts.values()))
        return cls(**{**counts, **knobs})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "WorldConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"WorldConfig.from_dict: unknown fields {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**dict(values))


@dataclass(frozen=True)
class Entity:
    """One entity: ``relations`` maps relation -> object entity id, ``attributes`` maps attribute -> value."""

    id: str            # also the docid of its page, e.g. "city-0007"
    type: str
    name: str
    relations: Mapping[str, str]
    attributes: Mapping[str, Any]
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class World:
    """A generated world: entities by id, documents in corpus order, and reverse indexes for set questions."""

    config: WorldConfig
    entities: Mapping[str, Entity]
    documents: tuple[dict[str, str], ...]
    # (relation, object id) -> sorted subject ids; e.g. ("born_in", "city-0003") -> people born there.
    subjects_of: Mapping[tuple[str, str], tuple[str, ...]] = field(repr=False)
    by_name: Mapping[str, str] = field(repr=False)

    def of_type(self, entity_type: str) -> list[Entity]:
        return [e for e in self.entities.values() if e.type == entity_type]

    def entity(self, entity_id: str) -> Entity:
        return self.entities[entity_id]

    def obj(self, entity_id: str, relation: str) -> Entity:
        return self.entities[self.entities[entity_id].relations[relation]]

    def value(self, entity_id: str, attribute: str) -> Any:
        return self.entities[entity_id].attributes[attribute]

    def corpus_jsonl(self) -> bytes:
        """The corpus as JSONL bytes (one ``{docid, url, title, text}`` object per line), the canonical form."""
        return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in self.documents).encode("utf-8")

    def fingerprint(self) -> str:
        """sha256 of the corpus bytes and the facts: equal fingerprints mean identical worlds."""
        digest = hashlib.sha256(self.corpus_jsonl())
        for entity in self.entities.values():
            digest.update(json.dumps([entity.id, entity.type, entity.name, sorted(entity.relations.items()),
                                      sorted(entity.attributes.items()), list(entity.aliases)]).encode())
        return digest.hexdigest()

    def document(self, docid: str) -> dict[str, str]:
        return self.documents[self._doc_index[docid]]

    @property
    def _doc_index(self) -> dict[str, int]:
        cached = self.__dict__.get("_doc_index_cache")
        if cached is None:
            cached = {d["docid"]: i for i, d in enumerate(self.documents)}
            object.__setattr__(self, "_doc_index_cache", cached)
        return cached


# ------------------------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------------------------


def _pools() -> tuple[list[str], list[str], list[str]]:
    """Fixed partition of the name words into place words, first names and last names (seed-independent)."""
    pool = list(name_words())
    random.Random(20240601).shuffle(pool)
    half, quarter = len(pool) // 2, len(pool) // 4
    return pool[:half], pool[half:half + quarter], pool[half + quarter:]


def _split_word(word: str) -> tuple[str, str]:
    lower = word.lower()
    for syllable in SYLLABLES:
        if lower.startswith(syllable) and lower[len(syllable):] in SYLLABLES:
            return syllable, lower[len(syllable):]
    raise ValueError(f"not a name word: {word!r}")


def _lookalikes(word: str, allowed: set[str]) -> list[str]:
    first, second = _split_word(word)
    out = [(first + s).capitalize() for s in SYLLABLES if s != second]
    out += [(s + second).capitalize() for s in SYLLABLES if s != first]
    return [w for w in out if w in allowed]


class _NamePicker:
    """Draws unused words from a pool; with probability ``lookalike_rate`` a one-syllable variant of a used word."""

    def __init__(self, rng: random.Random, pool: list[str], lookalike_rate: float):
        self.rng, self.lookalike_rate = rng, lookalike_rate
        self.free = list(pool)
        self.rng.shuffle(self.free)
        self.free_set = set(self.free)
        self.used: list[str] = []

    def take(self) -> str:
        word = None
        if self.used and self.rng.random() < self.lookalike_rate:
            base = self.used[self.rng.randrange(len(self.used))]
            candidates = _lookalikes(base, self.free_set)
            if candidates:
                word = candidates[self.rng.randrange(len(candidates))]
        if word is None:
            while self.free[-1] not in self.free_set:
                self.free.pop()
            word = self.free[-1]
        self.free_set.discard(word)
        self.used.append(word)
        return word


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def join_names(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " and " + names[-1]


def build_world(config: WorldConfig = WorldConfig()) -> World:
    """Generate the world for ``config`` (deterministic)."""
    rng = random.Random(config.seed)
    place_pool, first_pool, last_pool = _pools()
    places = _NamePicker(rng, place_pool, config.lookalike_rate)
    entities: dict[str, Entity] = {}
    relations: dict[str, dict[str, str]] = {}
    attributes: dict[str, dict[str, Any]] = {}

    def add(entity_type: str, index: int, name: str, aliases: tuple[str, ...] = ()) -> str:
        entity_id = f"{entity_type}-{index:05d}"
        entities[entity_id] = Entity(entity_id, entity_type, name, {}, {}, aliases)
        relations[entity_id], attributes[entity_id] = {}, {}
        return entity_id

    rivers = [add("river", i, f"{w} River", (w,)) for i, w in enumerate(places.take() for _ in range(config.num_rivers))]
    cities = [add("city", i, places.take()) for i in range(config.num_cities)]
    universities = [add("university", i, f"{places.take()} {UNIVERSITY_SUFFIXES[rng.randrange(3)]}")
                    for i in range(config.num_universities)]
    companies = [add("company", i, f"{places.take()} {COMPANY_SUFFIXES[rng.randrange(len(COMPANY_SUFFIXES))]}")
                 for i in range(config.num_companies)]

    # People: first + last name; look-alikes share the first name and differ by a syllable in the last name.
    people_names: set[str] = set()
    last_set = set(last_pool)
    people: list[str] = []
    for i in range(config.num_people):
        name = None
        if people and rng.random() < config.lookalike_rate:
            base_first, base_last = entities[people[rng.randrange(len(people))]].name.split(" ")
            variants = [f"{base_first} {w}" for w in _lookalikes(base_last, last_set)]
            variants = [v for v in variants if v not in people_names]
            if variants:
                name = variants[rng.randrange(len(variants))]
        while name is None or name in people_names:
            name = f"{first_pool[rng.randrange(len(first_pool))]} {last_pool[rng.randrange(len(last_pool))]}"
        people_names.add(name)
        people.append(add("person", i, name))

    # Unique numeric values where questions compare or look them up.
    for river, length in zip(rivers, rng.sample(range(80, 4000), len(rivers))):
        attributes[river]["length_km"] = length
    for city, population in zip(cities, rng.sample(range(3, 3000), len(cities))):
        attributes[city]["population"] = population * 1000 + rng.randrange(1, 1000)
    for i, city in enumerate(cities):
        attributes[city]["founded_year"] = rng.randrange(800, 1800)
        # Every river gets at least one city when there are enough cities.
        relations[city]["on_river"] = rivers[i] if i < len(rivers) else rivers[rng.randrange(len(rivers))]
    for university in universities:
        attributes[university]["university_founded_year"] = rng.randrange(1400, 1960)
        relations[university]["located_in"] = cities[rng.randrange(len(cities))]
    for company in companies:
        attributes[company]["company_founded_year"] = rng.randrange(1800, 2020)
        attributes[company]["industry"] = INDUSTRIES[rng.randrange(len(INDUSTRIES))]
        relations[company]["headquartered_in"] = cities[rng.randrange(len(cities))]
    for person in people:
        attributes[person]["birth_year"] = rng.randrange(1900, 2001)
        attributes[person]["profession"] = PROFESSIONS[rng.randrange(len(PROFESSIONS))]
        relations[person]["born_in"] = cities[rng.randrange(len(cities))]
        relations[person]["works_for"] = companies[rng.randrange(len(companies))]
        relations[person]["studied_at"] = universities[rng.randrange(len(universities))]

    entities = {eid: dataclasses.replace(e, relations=dict(sorted(relations[eid].items())),
                                         attributes=dict(sorted(attributes[eid].items())))
                for eid, e in entities.items()}
    subjects_of: dict[tuple[str, str], list[str]] = {}
    for eid, entity in entities.items():
        for relation, target in entity.relations.items():
            subjects_of.setdefault((relation, target), []).append(eid)
    subjects = {key: tuple(sorted(ids)) for key, ids in sorted(subjects_of.items())}
    by_name = {e.name: eid for eid, e in entities.items()}
    if len(by_name) != len(entities):
        raise AssertionError("entity names must be unique")

    all_names = [e.name for e in entities.values()]
    documents = [_entity_document(rng, config, entities[eid], entities, subjects, all_names) for eid in entities]
    for k in range(config.noise_docs):
        documents.append(_noise_document(rng, k, all_names))
    return World(config=config, entities=entities, documents=tuple(documents), subjects_of=subjects,
                 by_name=by_name)


def slug(name: str) -> str:
    return name.replace(" ", "_")


def fact_value_text(entity: Entity, key: str, entities: Mapping[str, Entity]) -> str:
    """How the value of relation/attribute ``key`` of ``entity`` is written in documents and answers."""
    if key in entity.relations:
        return entities[entity.relations[key]].name
    return str(entity.attributes[key])


def _entity_document(rng: random.Random, config: WorldConfig, entity: Entity, entities: Mapping[str, Entity],
                     subjects_of: Mapping[tuple[str, str], tuple[str, ...]], all_names: list[str]) -> dict[str, str]:
    name = entity.name
    # Rivers read "the Kalo River" mid-sentence; sentences are capitalised below.
    subject = f"the {name}" if entity.type == "river" else name

    def other_name() -> str:
        while True:
            candidate = all_names[rng.randrange(len(all_names))]
            if candidate != name:
                return candidate
    intro = INTRO_TEMPLATES[entity.type][rng.randrange(2)].format(s=name)
    facts: list[str] = []
    for key in list(entity.relations) + list(entity.attributes):
        templates = FACT_TEMPLATES[key]
        facts.append(templates[rng.randrange(len(templates))].format(s=name, o=fact_value_text(entity, key,
                                                                                              entities)))
    for relation in LIST_RELATION_FOR_TYPE.get(entity.type, ()):
        members = [entities[s].name for s in subjects_of.get((relation, entity.id), ())]
        if members:
            templates = LIST_TEMPLATES[relation]
            facts.append(templates[rng.randrange(len(templates))].format(s=name, o=join_names(members)))
    rng.shuffle(facts)
    lead, deep = [], []
    for sentence in facts:
        (deep if rng.random() < config.deep_fact_prob else lead).append(sentence)

    def filler() -> str:
        a, a2 = rng.sample(ADJECTIVES, 2)
        return _capitalise(FILLER_TEMPLATES[rng.randrange(len(FILLER_TEMPLATES))].format(
            s=subject, n=NOUNS[rng.randrange(len(NOUNS))], a=a, a2=a2))

    def distractor() -> str:
        return _capitalise(DISTRACTOR_TEMPLATES[rng.randrange(len(DISTRACTOR_TEMPLATES))].format(
            s=subject, x=other_name(), y=rng.randrange(1700, 2020), k=rng.randrange(2, 900)))

    body = lead + [distractor() for _ in range(config.distractors_per_doc)] + [filler() for _ in
                                                                              range(config.filler_per_doc)]
    rng.shuffle(body)
    paragraphs = [[intro] + body]
    if deep:
        background = [filler() for _ in range(config.deep_offset)]
        paragraphs.append(background[: len(background) // 2])
        paragraphs.append(background[len(background) // 2:])
        paragraphs.append(deep)
    text = "\n\n".join(" ".join(p) for p in paragraphs if p)
    return {"docid": entity.id, "url": URL_PREFIX + slug(name), "title": name, "text": text}


def _noise_document(rng: random.Random, k: int, names: list[str]) -> dict[str, str]:
    sentences = []
    for _ in range(6):
        x, x2 = rng.sample(names, 2)
        sentences.append(NOISE_TEMPLATES[rng.randrange(len(NOISE_TEMPLATES))].format(
            x=x, x2=x2, a=ADJECTIVES[rng.randrange(len(ADJECTIVES))], n=NOUNS[rng.randrange(len(NOUNS))]))
    title = NOISE_TITLE.format(k=k + 1)
    return {"docid": f"noise-{k:05d}", "url": URL_PREFIX + slug(title), "title": title, "text": " ".join(sentences)}
