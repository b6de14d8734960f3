"""processor/globs.py: a compiled glob list (plain names, prefix and suffix patterns by length, one expression for
the rest) selects what fnmatch selects. Reference: `fnmatch.fnmatchcase` on every (name, glob) pair; exact."""

from __future__ import annotations

import fnmatch
import random
import time

from msmodelslim.processor.globs import any_match


def test_a_compiled_glob_list_matches_what_fnmatch_matches():
    rng = random.Random(0)
    parts = ["layers", "1", "12", "experts", "w1", "q_proj", "self_attn", "mlp", ""]
    names = {".".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(400)}
    for _ in range(200):
        globs = []
        for _ in range(rng.randint(1, 6)):
            glob = ".".join(rng.choice([*parts, "*", "1?", "[0-9]", "*w1"]) for _ in range(rng.randint(1, 4)))
            globs.append(rng.choice([glob, "*" + glob, glob + "*", "*", "*" + glob + "*"]))
        for name in names:
            assert any_match(name, globs) == any(fnmatch.fnmatchcase(name, g) for g in globs), (name, globs)


def test_four_hundred_suffix_patterns_over_kimi_k3s_expert_linears_take_a_second_not_minutes():
    """~250k names (93 layers x 896 experts x 3), 400 `*...` patterns: under 10 s (0.8 s on the 2-core sandbox; one
    expression of them took 18 s, and one glob at a time minutes)."""
    names = [f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
             for layer in range(93) for e in range(896) for w in ("w1", "w2", "w3")]
    globs = [f"*layers.{layer}.block_sparse_moe.experts.{e}.w1" for layer in range(80) for e in range(5)]
    start = time.perf_counter()
    assert sum(any_match(name, globs) for name in names) == 400
    assert time.perf_counter() - start < 10
