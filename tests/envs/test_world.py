"""Specification of the procedural world: determinism, unique names, closed vocabulary, difficulty knobs."""

import hashlib

import pytest

from trace_jax.envs.world import WorldConfig, build_world, vocabulary, words

SMALL = WorldConfig(seed=3, num_people=60, num_cities=12, num_rivers=4, num_universities=6, num_companies=15,
                    noise_docs=5)


def test_same_seed_gives_byte_identical_world():
    first, second = build_world(SMALL), build_world(SMALL)
    assert hashlib.sha256(first.corpus_jsonl()).hexdigest() == hashlib.sha256(second.corpus_jsonl()).hexdigest()
    assert first.fingerprint() == second.fingerprint()


def test_world_fingerprint_is_pinned_for_the_default_config():
    # Guards against accidental changes to generation (and to Python's seeded random streams).
    assert build_world(WorldConfig(seed=0)).fingerprint()[:16] == PINNED_DEFAULT_FINGERPRINT


def test_different_seeds_give_different_worlds():
    other = WorldConfig(**{**SMALL.to_dict(), "seed": 4})
    assert build_world(SMALL).fingerprint() != build_world(other).fingerprint()


def test_one_document_per_entity_plus_noise_pages():
    world = build_world(SMALL)
    docids = [d["docid"] for d in world.documents]
    assert len(docids) == len(set(docids)) == len(world.entities) + SMALL.noise_docs
    assert all(set(d) == {"docid", "url", "title", "text"} for d in world.documents)
    assert len({d["url"] for d in world.documents}) == len(docids)


def test_entity_names_are_unique_and_every_fact_is_written_on_its_page():
    world = build_world(SMALL)
    assert len({e.name for e in world.entities.values()}) == len(world.entities)
    for entity in world.entities.values():
        text = world.document(entity.id)["text"]
        for relation, target in entity.relations.items():
            assert world.entities[target].name in text
        for value in entity.attributes.values():
            assert str(value) in text


def test_city_pages_list_everyone_born_there():
    world = build_world(SMALL)
    for city in world.of_type("city"):
        text = world.document(city.id)["text"]
        for person_id in world.subjects_of.get(("born_in", city.id), ()):
            assert world.entities[person_id].name in text


def test_vocabulary_covers_every_document_token():
    world = build_world(WorldConfig(seed=9, lookalike_rate=0.5, deep_fact_prob=0.5))
    vocab = set(vocabulary())
    for document in world.documents:
        for field in ("docid", "url", "title", "text"):
            assert set(words(document[field])) <= vocab, document["docid"]


def test_vocabulary_is_sorted_unique_and_independent_of_seed():
    vocab = vocabulary()
    assert vocab == sorted(set(vocab))
    assert "Kalo" in vocab and "7" in vocab and "," in vocab


def test_deep_facts_sit_after_the_background_filler():
    deep = build_world(WorldConfig(**{**SMALL.to_dict(), "deep_fact_prob": 1.0, "deep_offset": 30}))
    for entity in list(deep.entities.values())[:20]:
        text = deep.document(entity.id)["text"]
        # Intro + two background paragraphs come first; the last paragraph holds every fact.
        last_paragraph = text.split("\n\n")[-1]
        for value in entity.attributes.values():
            assert str(value) in last_paragraph
        assert len(text.split("\n\n")) == 4


def test_lookalike_names_differ_by_one_syllable():
    world = build_world(WorldConfig(**{**SMALL.to_dict(), "lookalike_rate": 1.0}))
    cities = sorted(e.name for e in world.of_type("city"))
    near = sum(1 for a in cities for b in cities if a != b and len(a) == len(b)
               and sum(x != y for x, y in zip(a, b)) <= 3 and (a[:2] == b[:2] or a[-2:] == b[-2:]))
    assert near > 0


def test_corpus_size_knob_scales_the_document_count():
    config = WorldConfig.from_corpus_size(1000, noise_docs=0)
    assert abs(len(build_world(config).documents) - 1000) <= 5


@pytest.mark.parametrize("bad", [dict(num_people=0), dict(deep_fact_prob=1.5), dict(num_cities=2000),
                                 dict(noise_docs=-1)])
def test_invalid_config_is_rejected_with_the_field_name(bad):
    with pytest.raises(ValueError, match=list(bad)[0] if list(bad)[0] != "num_cities" else "place-name"):
        WorldConfig(**bad)


PINNED_DEFAULT_FINGERPRINT = "d03d2ce2c7c02a44"
