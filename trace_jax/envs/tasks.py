"""Procedural multi-hop questions over a generated world, each with its gold answer and gold clue chain.

Five question types, as in the paper's training data:
  * ``bridge``: follow 1-4 functional relations from a named entity ("How long is the river that flows through the
    city where Ana Kalo was born, in kilometres?").
  * ``reverse``: identify an entity by a unique attribute value, then optionally follow relations
    ("In which city is the university founded in 1643 located?").
  * ``intersection``: the one member of a listed set that satisfies a second condition
    ("Which person born in Kalo studied at Venmir College?").
  * ``counting``: how many members of a listed set satisfy a filter ("How many companies headquartered in Kalo were
    founded before 1950?").
  * ``comparative``: which of two entities has the larger/earlier attribute.

``hops`` counts the facts on the longest path from a named entity to the answer (list pages count as one hop).
Every task carries a ``program`` (a small logical form); ``evaluate_program`` answers it by brute force over the
world's facts, and generation keeps a question only when that gives exactly one answer equal to the gold answer.
The clue chain lists, in path order, each fact the solver must see: the page (docid) it is on, the entity the page
is about, the relation, the value text, and whether it supports the answer or rules a candidate out ("exclude").

This module knows nothing about search, tools, tokenizers or datasets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from trace_jax.envs.world import (ATTRIBUTES, NUMBER_WORDS, PROFESSION_PLURALS, RELATIONS, Entity,
                                  World)

QUESTION_TYPES = ("bridge", "reverse", "intersection", "counting", "comparative")
CLUE_KINDS = ("support", "exclude")

# Noun phrase for the object of a relation, given the subject's noun phrase {s}.
NP_TEMPLATES = {
    "born_in": "the city where {s} was born",
    "works_for": "the company that {s} works for",
    "studied_at": "the university where {s} studied",
    "headquartered_in": "the city where {s} is headquartered",
    "located_in": "the city where {s} is located",
    "on_river": "the river that flows through {s}",
}
# Final question asking for relation/attribute {key} of {s}.
ASK_TEMPLATES = {
    "born_in": "In which city was {s} born?",
    "works_for": "Which company does {s} work for?",
    "studied_at": "At which university did {s} study?",
    "headquartered_in": "In which city is {s} headquartered?",
    "located_in": "In which city is {s} located?",
    "on_river": "Which river flows through {s}?",
    "population": "What is the population of {s}?",
    "founded_year": "In what year was {s} founded?",
    "university_founded_year": "In what year was {s} founded?",
    "company_founded_year": "In what year was {s} founded?",
    "length_km": "How long is {s}, in kilometres?",
    "birth_year": "In what year was {s} born?",
    "profession": "What is the profession of {s}?",
    "industry": "In which industry does {s} operate?",
}
# Reverse lookup: identify an entity of a type by a (unique) attribute value.
IDENTIFY_NP = {
    "length_km": "the river that is {v} kilometres long",
    "population": "the city with a population of {v}",
    "founded_year": "the city founded in {v}",
    "university_founded_year": "the university founded in {v}",
    "company_founded_year": "the company founded in {v}",
}
IDENTIFY_ASK = {
    "length_km": "Which river is {v} kilometres long?",
    "population": "Which city has a population of {v}?",
    "founded_year": "Which city was founded in {v}?",
    "university_founded_year": "Which university was founded in {v}?",
    "company_founded_year": "Which company was founded in {v}?",
}
# Set questions: the members listed on an anchor's page (relation -> (member type, anchor type, phrase)).
MEMBER_PHRASE = {
    "born_in": "person born in {a}",
    "headquartered_in": "company headquartered in {a}",
    "on_river": "city on {a}",
}
MEMBERS_PHRASE = {
    "born_in": "people born in {a}",
    "headquartered_in": "companies headquartered in {a}",
    "on_river": "cities on {a}",
}
INTERSECT_FILTERS = {  # member key -> phrase for "the member ... {v}"
    "works_for": "works for {v}",
    "studied_at": "studied at {v}",
    "profession": "works as a {v}",
    "birth_year": "was born in the year {v}",
    "industry": "is a {v} company",
    "company_founded_year": "was founded in {v}",
    "founded_year": "was founded in {v}",
}
COUNT_FILTERS = {  # (key, comparison) -> phrase; "{v}" is the threshold or value
    ("studied_at", "eq"): "studied at {v}",
    ("works_for", "eq"): "work for {v}",
    ("profession", "eq"): "work as {v}",
    ("birth_year", "lt"): "were born before {v}",
    ("birth_year", "gt"): "were born after {v}",
    ("industry", "eq"): "are {v} companies",
    ("company_founded_year", "lt"): "were founded before {v}",
    ("company_founded_year", "gt"): "were founded after {v}",
    ("population", "gt"): "have a population above {v}",
    ("population", "lt"): "have a population below {v}",
    ("founded_year", "lt"): "were founded before {v}",
}
COMPARE_ASK = {  # (type, attribute) -> (question, "max" | "min")
    ("city", "population"): ("Which city has the larger population, {a} or {b}?", "max"),
    ("city", "founded_year"): ("Which city was founded earlier, {a} or {b}?", "min"),
    ("river", "length_km"): ("Which river is longer, {a} or {b}?", "max"),
    ("university", "university_founded_year"): ("Which university was founded earlier, {a} or {b}?", "min"),
    ("company", "company_founded_year"): ("Which company was founded earlier, {a} or {b}?", "min"),
    ("person", "birth_year"): ("Who was born earlier, {a} or {b}?", "min"),
}
# Every literal question text, so world.vocabulary() can list its words.
QUESTION_TEXTS: tuple[str, ...] = (
    tuple(NP_TEMPLATES.values()) + tuple(ASK_TEMPLATES.values()) + tuple(IDENTIFY_NP.values())
    + tuple(IDENTIFY_ASK.values()) + tuple(MEMBER_PHRASE.values()) + tuple(MEMBERS_PHRASE.values())
    + tuple(INTERSECT_FILTERS.values()) + tuple(COUNT_FILTERS.values()) + tuple(q for q, _ in COMPARE_ASK.values())
    + ("Which {m} {f}?", "How many {m} {f}?", "the {s}")
)

MAX_SET_SIZE = 10  # set questions read every listed member's page; keep that bounded.


class TaskError(ValueError):
    """A task record is malformed or a generation request cannot be met (the message says how to fix it)."""


@dataclass(frozen=True)
class Clue:
    """One fact on the gold path: found on page ``docid`` (about ``entity``) as ``relation`` = ``value``.

    ``kind`` is "support" for facts leading to the answer and "exclude" for facts ruling a candidate out (counting).
    External tasks without a chain have one clue per gold document: ``relation="gold_doc"``, empty entity/value.
    """

    docid: str
    entity: str
    relation: str
    value: str
    kind: str = "support"

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Task:
    """A question with its gold answer and gold clue chain.

    Attributes:
      task_id: unique id.
      question: the question text.
      answer: the gold answer text.
      aliases: other accepted spellings of the answer.
      qtype: one of ``QUESTION_TYPES`` (or "external").
      hops: facts on the longest path from a named entity to the answer (0 when unknown).
      clues: the gold clue chain, in path order.
      program: the logical form (JSON-able dict) the answer was verified with; ``{}`` for external tasks.
      source: "procedural" or the external dataset's name.
      world: the ``WorldConfig`` dict that regenerates the corpus (procedural), else ``{}``.
    """

    task_id: str
    question: str
    answer: str
    aliases: tuple[str, ...] = ()
    qtype: str = "bridge"
    hops: int = 0
    clues: tuple[Clue, ...] = ()
    program: Mapping[str, Any] = field(default_factory=dict)
    source: str = "procedural"
    world: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gold_answers(self) -> tuple[str, ...]:
        """The answer and its aliases: what ``answers.answer_reward`` takes as gold."""
        return (self.answer, *self.aliases)

    @property
    def gold_docids(self) -> tuple[str, ...]:
        """Docids of the clue chain, in order, without repeats."""
        return tuple(dict.fromkeys(c.docid for c in self.clues))

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "question": self.question, "answer": self.answer,
                "aliases": list(self.aliases), "qtype": self.qtype, "hops": self.hops,
                "clues": [c.to_dict() for c in self.clues], "program": self.program, "source": self.source,
                "world": dict(self.world)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], where: str = "task") -> "Task":
        if not isinstance(record, Mapping):
            raise TaskError(f"{where}: expected a JSON object, got {type(record).__name__}.")
        for name in ("task_id", "question", "answer"):
            if not isinstance(record.get(name), str):
                raise TaskError(f"{where}: field '{name}' must be a string, got {record.get(name)!r:.60}.")
        clues = []
        for index, clue in enumerate(record.get("clues", ())):
            if not isinstance(clue, Mapping) or not isinstance(clue.get("docid"), str):
                raise TaskError(f"{where}: clues[{index}] must be an object with a string 'docid'.")
            clues.append(Clue(docid=clue["docid"], entity=str(clue.get("entity", "")),
                              relation=str(clue.get("relation", "")), value=str(clue.get("value", "")),
                              kind=str(clue.get("kind", "support"))))
        return cls(task_id=record["task_id"], question=record["question"], answer=record["answer"],
                   aliases=tuple(str(a) for a in record.get("aliases", ())), qtype=str(record.get("qtype", "")),
                   hops=int(record.get("hops", 0)), clues=tuple(clues), program=dict(record.get("program", {})),
                   source=str(record.get("source", "procedural")), world=dict(record.get("world", {})))


@dataclass(frozen=True)
class TaskConfig:
    """Knobs of question generation.

    Attributes:
      min_hops / max_hops: range of hops (1-4); each type uses the part of the range it can reach
        (bridge 1-4, reverse 1-4, intersection/counting 2-4, comparative 1-3).
      type_weights: relative frequency of each question type, as (type, weight) pairs.
    """

    min_hops: int = 1
    max_hops: int = 4
    type_weights: tuple[tuple[str, float], ...] = tuple((t, 1.0) for t in QUESTION_TYPES)

    def __post_init__(self):
        if not 1 <= self.min_hops <= self.max_hops <= 4:
            raise ValueError(f"TaskConfig: need 1 <= min_hops <= max_hops <= 4, got {self.min_hops}, "
                             f"{self.max_hops}.")
        weights = dict(self.type_weights)
        unknown = set(weights) - set(QUESTION_TYPES)
        if unknown or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"TaskConfig.type_weights: types must be from {QUESTION_TYPES} with non-negative "
                             f"weights summing to > 0, got {self.type_weights!r}.")


HOP_RANGE = {"bridge": (1, 4), "reverse": (1, 4), "intersection": (2, 4), "counting": (2, 4),
             "comparative": (1, 3)}

# ------------------------------------------------------------------------------------------------------------------
# Evaluation of programs (brute force over facts)
# ------------------------------------------------------------------------------------------------------------------


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "eq":
        return left == right
    if op == "lt":
        return left < right
    if op == "gt":
        return left > right
    raise TaskError(f"unknown comparison {op!r}; expected eq, lt or gt.")


def _select(world: World, program: Mapping[str, Any]) -> list[str]:
    conditions = []
    for key, op, value in program["where"]:
        if key in RELATIONS:
            targets = _evaluate(world, value) if isinstance(value, Mapping) else {world.by_name.get(value)}
            conditions.append((key, True, targets))
        else:
            conditions.append((key, op, value))
    out = []
    for entity in world.entities.values():
        if entity.type != program["type"]:
            continue
        ok = True
        for key, op, value in conditions:
            if op is True:
                ok = entity.relations.get(key) in value
            else:
                ok = key in entity.attributes and _compare(entity.attributes[key], op, value)
            if not ok:
                break
        if ok:
            out.append(entity.id)
    return out


def _evaluate(world: World, program: Mapping[str, Any]) -> set:
    op = program["op"]
    if op == "name":
        return {world.by_name[program["name"]]} if program["name"] in world.by_name else set()
    if op == "rel":
        return {world.entities[x].relations[program["rel"]] for x in _evaluate(world, program["of"])}
    if op == "attr":
        return {world.entities[x].attributes[program["attr"]] for x in _evaluate(world, program["of"])}
    if op == "select":
        return set(_select(world, program))
    if op == "count":
        return {len(_select(world, program))}
    if op in ("argmax", "argmin"):
        left, right = (_evaluate(world, side) for side in program["of"])
        winners = set()
        for a in left:
            for b in right:
                va, vb = world.entities[a].attributes[program["attr"]], world.entities[b].attributes[program["attr"]]
                if va == vb:
                    winners.update({a, b})
                else:
                    winners.add(a if (va > vb) == (op == "argmax") else b)
        return winners
    raise TaskError(f"unknown program op {op!r}.")


def evaluate_program(world: World, program: Mapping[str, Any]) -> set[str]:
    """All answers the program has in ``world``, as answer texts (entity names or numbers as decimal strings)."""
    return {world.entities[x].name if isinstance(x, str) and x in world.entities else str(x)
            for x in _evaluate(world, program)}


def verify_task(world: World, task: Task) -> None:
    """Raise ``TaskError`` unless the task's program has exactly one answer in ``world`` and it is ``task.answer``."""
    answers = evaluate_program(world, task.program)
    if answers != {task.answer}:
        raise TaskError(f"task {task.task_id}: program answers {sorted(answers)!r}, gold answer {task.answer!r}.")


# ------------------------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------------------------


def _paths_into(target_type: str, depth: int) -> list[tuple[str, ...]]:
    """Relation sequences of length ``depth`` that end at ``target_type`` (first relation starts the walk)."""
    if depth == 0:
        return [()]
    out = []
    for relation, (subject_type, object_type) in RELATIONS.items():
        if object_type == target_type:
            out += [path + (relation,) for path in _paths_into(subject_type, depth - 1)]
    return out


def _name_np(entity: Entity) -> str:
    return f"the {entity.name}" if entity.type == "river" else entity.name


def _value_text(world: World, entity: Entity, key: str) -> str:
    if key in entity.relations:
        return world.entities[entity.relations[key]].name
    return str(entity.attributes[key])


class _Generator:
    def __init__(self, world: World, rng: random.Random):
        self.world, self.rng = world, rng
        self.by_type = {t: [e for e in world.entities.values() if e.type == t]
                        for t in ("river", "city", "university", "company", "person")}

    def pick(self, entity_type: str) -> Entity:
        pool = self.by_type[entity_type]
        return pool[self.rng.randrange(len(pool))]

    def clue(self, entity: Entity, key: str, kind: str = "support") -> Clue:
        return Clue(docid=entity.id, entity=entity.name, relation=key, value=_value_text(self.world, entity, key),
                    kind=kind)

    def walk(self, start: Entity, start_np: str, start_program: dict, path: Sequence[str]):
        """Follow ``path`` from ``start``: returns (noun phrase, program, clues, end entity)."""
        np, program, clues, entity = start_np, start_program, [], start
        for relation in path:
            clues.append(self.clue(entity, relation))
            np = NP_TEMPLATES[relation].format(s=np)
            program = {"op": "rel", "rel": relation, "of": program}
            entity = self.world.entities[entity.relations[relation]]
        return np, program, clues, entity

    def noun_phrase(self, target_type: str, depth: int):
        """A description of an entity of ``target_type`` reached by ``depth`` hops from a named entity."""
        paths = _paths_into(target_type, depth)
        if not paths:
            return None
        path = paths[self.rng.randrange(len(paths))]
        start_type = RELATIONS[path[0]][0] if path else target_type
        start = self.pick(start_type)
        return self.walk(start, _name_np(start), {"op": "name", "name": start.name}, path)

    # -- the five types ---------------------------------------------------------------------------------------------

    def bridge(self, hops: int):
        keys = list(RELATIONS) + list(ATTRIBUTES)
        self.rng.shuffle(keys)
        for key in keys:
            subject_type = (RELATIONS.get(key) or ATTRIBUTES[key])[0]
            made = self.noun_phrase(subject_type, hops - 1)
            if made is None:
                continue
            np, program, clues, entity = made
            question = _capitalise(ASK_TEMPLATES[key].format(s=np))
            program = {"op": "rel" if key in RELATIONS else "attr", ("rel" if key in RELATIONS else "attr"): key,
                       "of": program}
            return question, _value_text(self.world, entity, key), clues + [self.clue(entity, key)], program, entity
        return None

    def reverse(self, hops: int):
        key = list(IDENTIFY_NP)[self.rng.randrange(len(IDENTIFY_NP))]
        entity_type = ATTRIBUTES[key][0]
        entity = self.pick(entity_type)
        value = entity.attributes[key]
        if sum(1 for e in self.by_type[entity_type] if e.attributes[key] == value) != 1:
            return None
        identify = {"op": "select", "type": entity_type, "where": [[key, "eq", value]]}
        first_clue = self.clue(entity, key)
        if hops == 1:
            return (IDENTIFY_ASK[key].format(v=value), entity.name, [first_clue], identify, entity)
        # hops - 2 relations, then a final relation or attribute.
        candidates = []
        for final in list(RELATIONS) + list(ATTRIBUTES):
            final_type = (RELATIONS.get(final) or ATTRIBUTES[final])[0]
            for path in _paths_into(final_type, hops - 2):
                if (path and RELATIONS[path[0]][0] == entity_type) or (not path and final_type == entity_type):
                    candidates.append((path, final))
        if not candidates:
            return None
        path, final = candidates[self.rng.randrange(len(candidates))]
        if final in IDENTIFY_NP and not path:  # "In what year was the city founded in 1203 founded?"
            return None
        np, program, clues, end = self.walk(entity, IDENTIFY_NP[key].format(v=value), identify, path)
        question = _capitalise(ASK_TEMPLATES[final].format(s=np))
        op_key = "rel" if final in RELATIONS else "attr"
        program = {"op": op_key, op_key: final, "of": program}
        return question, _value_text(self.world, end, final), [first_clue] + clues + [self.clue(end, final)], \
            program, end

    def _anchor(self, hops: int):
        relation = list(MEMBER_PHRASE)[self.rng.randrange(len(MEMBER_PHRASE))]
        member_type, anchor_type = RELATIONS[relation]
        made = self.noun_phrase(anchor_type, hops - 2)
        if made is None:
            return None
        np, program, clues, anchor = made
        members = [self.world.entities[m] for m in self.world.subjects_of.get((relation, anchor.id), ())]
        if not 2 <= len(members) <= MAX_SET_SIZE:
            return None
        return relation, member_type, np, program, clues, anchor, members

    def intersection(self, hops: int):
        made = self._anchor(hops)
        if made is None:
            return None
        relation, member_type, np, anchor_program, clues, anchor, members = made
        target = members[self.rng.randrange(len(members))]
        keys = [k for k in INTERSECT_FILTERS if k in target.relations or k in target.attributes]
        self.rng.shuffle(keys)
        for key in keys:
            value = _value_text(self.world, target, key)
            if sum(1 for m in members if _value_text(self.world, m, key) == value) != 1:
                continue
            question = f"Which {MEMBER_PHRASE[relation].format(a=np)} {INTERSECT_FILTERS[key].format(v=value)}?"
            where_value = {"op": "name", "name": value} if key in RELATIONS else target.attributes[key]
            program = {"op": "select", "type": member_type,
                       "where": [[relation, "eq", anchor_program], [key, "eq", where_value]]}
            chain = clues + [Clue(anchor.id, anchor.name, f"list:{relation}", target.name),
                             self.clue(target, relation), self.clue(target, key)]
            return question, target.name, chain, program, target
        return None

    def counting(self, hops: int):
        made = self._anchor(hops)
        if made is None:
            return None
        relation, member_type, np, anchor_program, clues, anchor, members = made
        options = [(k, op) for (k, op) in COUNT_FILTERS if k in members[0].relations or k in members[0].attributes]
        key, op = options[self.rng.randrange(len(options))]
        pivot = members[self.rng.randrange(len(members))]
        if key in RELATIONS:
            value = self.world.entities[pivot.relations[key]].name
            matches = [m for m in members if _value_text(self.world, m, key) == value]
            where_value: Any = {"op": "name", "name": value}
            shown = value
        elif op == "eq":
            value = pivot.attributes[key]
            matches = [m for m in members if m.attributes[key] == value]
            where_value = value
            shown = PROFESSION_PLURALS.get(value, value)
        else:
            raw = pivot.attributes[key]
            value = raw + 1 if op == "lt" else raw - 1
            if key == "population":
                value = (raw // 1000) * 1000 if op == "gt" else (raw // 1000 + 1) * 1000
            matches = [m for m in members if _compare(m.attributes[key], op, value)]
            where_value = shown = value
        question = f"How many {MEMBERS_PHRASE[relation].format(a=np)} {COUNT_FILTERS[(key, op)].format(v=shown)}?"
        program = {"op": "count", "type": member_type, "where": [[relation, "eq", anchor_program],
                                                                  [key, op, where_value]]}
        chain = list(clues)
        for member in members:
            chain.append(Clue(anchor.id, anchor.name, f"list:{relation}", member.name))
        for member in members:
            chain.append(self.clue(member, key, "support" if member in matches else "exclude"))
        return question, str(len(matches)), chain, program, None

    def comparative(self, hops: int):
        (entity_type, attribute), (template, direction) = list(COMPARE_ASK.items())[
            self.rng.randrange(len(COMPARE_ASK))]
        sides = [self.noun_phrase(entity_type, hops - 1) for _ in range(2)]
        if any(s is None for s in sides):
            return None
        (np_a, prog_a, clues_a, a), (np_b, prog_b, clues_b, b) = sides
        if a.id == b.id or a.attributes[attribute] == b.attributes[attribute] or np_a == np_b:
            return None
        if direction == "max":
            winner = a if a.attributes[attribute] > b.attributes[attribute] else b
        else:
            winner = a if a.attributes[attribute] < b.attributes[attribute] else b
        question = _capitalise(template.format(a=np_a, b=np_b))
        program = {"op": "argmax" if direction == "max" else "argmin", "attr": attribute, "of": [prog_a, prog_b]}
        chain = clues_a + [self.clue(a, attribute)] + clues_b + [self.clue(b, attribute)]
        return question, winner.name, chain, program, winner


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _aliases(world: World, qtype: str, answer: str, entity: Entity | None) -> tuple[str, ...]:
    if qtype == "counting":
        count = int(answer)
        return (NUMBER_WORDS[count],) if count < len(NUMBER_WORDS) else ()
    return tuple(entity.aliases) if entity is not None and entity.name == answer else ()


def generate_tasks(world: World, num_tasks: int, seed: int = 0, config: TaskConfig = TaskConfig(), *,
                   exclude_questions: Iterable[str] = (), id_prefix: str | None = None) -> list[Task]:
    """Generate ``num_tasks`` distinct, verified questions over ``world`` (deterministic in world and seed).

    Questions in ``exclude_questions`` are skipped (use it to keep splits disjoint). Raises ``TaskError`` when the
    world is too small to yield that many distinct questions.
    """
    rng = random.Random(seed * 1_000_003 + world.config.seed)
    generator = _Generator(world, rng)
    weights = dict(config.type_weights)
    types = [t for t in QUESTION_TYPES if weights.get(t, 0) > 0
             and max(HOP_RANGE[t][0], config.min_hops) <= min(HOP_RANGE[t][1], config.max_hops)]
    if not types:
        raise TaskError(f"no question type with positive weight can reach hops {config.min_hops}-{config.max_hops}.")
    type_weights = [weights[t] for t in types]
    seen = set(exclude_questions)
    prefix = id_prefix if id_prefix is not None else f"w{world.config.seed}-s{seed}"
    world_dict = world.config.to_dict()
    tasks: list[Task] = []
    failures = 0  # consecutive attempts without a new question
    while len(tasks) < num_tasks:
        failures += 1
        if failures > 3000:
            raise TaskError(f"could only make {len(tasks)} of {num_tasks} distinct questions; enlarge the world "
                            "(WorldConfig counts) or widen the hop range.")
        qtype = rng.choices(types, weights=type_weights)[0]
        low, high = max(HOP_RANGE[qtype][0], config.min_hops), min(HOP_RANGE[qtype][1], config.max_hops)
        hops = rng.randint(low, high)
        made = getattr(generator, qtype)(hops)
        if made is None:
            continue
        question, answer, clues, program, entity = made
        if question in seen:
            continue
        task = Task(task_id=f"{prefix}-{len(tasks):06d}", question=question, answer=answer,
                    aliases=_aliases(world, qtype, answer, entity), qtype=qtype, hops=hops, clues=tuple(clues),
                    program=program, source="procedural", world=world_dict)
        verify_task(world, task)
        failures = 0
        seen.add(question)
        tasks.append(task)
    return tasks


def generate_splits(world: World, sizes: Mapping[str, int], seed: int = 0,
                    config: TaskConfig = TaskConfig()) -> dict[str, list[Task]]:
    """Disjoint (by question text) task lists per split name, e.g. ``{"train": 1000, "validation": 100}``."""
    seen: set[str] = set()
    splits = {}
    for index, (name, size) in enumerate(sizes.items()):
        split_tasks = generate_tasks(world, size, seed=seed * 101 + index, config=config, exclude_questions=seen,
                                     id_prefix=f"w{world.config.seed}-{name}")
        seen.update(t.question for t in split_tasks)
        splits[name] = split_tasks
    return splits


def tasks_fingerprint(tasks: Sequence[Task]) -> str:
    """sha256 over the tasks' canonical JSON lines."""
    digest = hashlib.sha256()
    for task in tasks:
        digest.update(task.to_json().encode("utf-8") + b"\n")
    return digest.hexdigest()


def clue_matches(clues: Sequence[Clue], text: str, docid: str | None = None) -> list[int]:
    """Indices of the clues that ``text`` (e.g. one tool observation) reveals: for the ABC step score and progress.

    A clue with a value matches when its value occurs in ``text`` (browser line prefixes ``L12: `` removed and
    whitespace collapsed, so values wrapped across display lines still match) and, when ``docid`` is given, the text
    comes from the clue's page. A clue without a value (external tasks: gold documents) matches when ``docid`` is
    its page.
    """
    flat = " ".join(re.sub(r"(?m)^L\d+: ", "", text).split())
    out = []
    for index, clue in enumerate(clues):
        if clue.value:
            if clue.value in flat and (docid is None or docid == clue.docid):
                out.append(index)
        elif docid is not None and docid == clue.docid:
            out.append(index)
    return out
