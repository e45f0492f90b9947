"""The 1.5B bench's verdicts (`llm_big._targets`): which paired ratios each target reads, without a model."""

from __future__ import annotations

from typing import Any

from runtime.bench import llm_big


def _pairs(decode: tuple[float, float], prefill: tuple[float, float]) -> dict[str, Any]:
    return {"paired_decode": {"1t": {"median_ratio": decode[0]}, "2t": {"median_ratio": decode[1]}},
            "paired_prefill": {"1t": {"median_ratio": prefill[0]}, "2t": {"median_ratio": prefill[1]}}}


def test_avx2_targets_read_the_forced_child_where_it_ran() -> None:
    out = {**_pairs((1.2, 1.1), (1.9, 1.8)), "avx2_forced": _pairs((0.95, 1.05), (1.1, 0.9))}
    t = llm_big._targets(out)
    assert t["decode_vs_llama_cpp_1t"] == {"ratio": 1.2, "target": ">= 1.0", "met": True}
    assert t["decode_vs_llama_cpp_1t_avx2"]["ratio"] == 0.95 and not t["decode_vs_llama_cpp_1t_avx2"]["met"]
    assert t["prefill_vs_llama_cpp_2t_avx2"]["ratio"] == 0.9 and not t["prefill_vs_llama_cpp_2t_avx2"]["met"]


def test_on_an_avx2_only_cpu_the_avx2_targets_read_the_main_pairs() -> None:
    out = {**_pairs((0.93, 1.06), (1.85, 1.87)), "avx2_forced": {"skipped": "this CPU's widest kernel path is AVX2",
                                                                 "rows_above_are_avx2": True}}
    t = llm_big._targets(out)
    for label in ("decode", "prefill"):
        for threads in (1, 2):
            assert t[f"{label}_vs_llama_cpp_{threads}t_avx2"] == t[f"{label}_vs_llama_cpp_{threads}t"]
    assert not t["decode_vs_llama_cpp_1t_avx2"]["met"] and t["decode_vs_llama_cpp_2t_avx2"]["met"]


def test_a_failed_child_meets_no_avx2_target() -> None:
    out = {**_pairs((1.2, 1.1), (1.9, 1.8)), "avx2_forced": {"skipped": "the AVX2 child failed: boom"}}
    t = llm_big._targets(out)
    assert t["decode_vs_llama_cpp_1t_avx2"] == {"ratio": None, "target": ">= 1.0", "met": False}


def test_auto_is_judged_against_the_candidate_chosen_on_other_rounds() -> None:
    spec = {"transcript_qa": {"auto": {"speedup": 1.8}, "ngram": {"speedup": 1.9}, "trigram": {"speedup": 1.7}},
            "auto_vs_best_held_out": {"transcript_qa": {"ratio": 1.02}}}
    t = llm_big._targets({**_pairs((1.2, 1.1), (1.9, 1.8)), "speculative": spec})
    verdict = t["auto_vs_best_candidate_transcript_qa"]
    assert verdict["ratio_same_rounds"] == round(1.8 / 1.9, 3) and verdict["ratio_held_out"] == 1.02 and verdict["met"]
    assert t["speculative_transcript_qa"] == {"auto": 1.8, "target": ">= 1.6", "met": True}
    spec["auto_vs_best_held_out"]["transcript_qa"]["ratio"] = 0.97
    assert not llm_big._targets({"speculative": spec})["auto_vs_best_candidate_transcript_qa"]["met"]


def test_the_avx2_targets_say_which_llama_cpp_the_child_raced() -> None:
    child = {**_pairs((0.95, 1.05), (1.1, 0.9)), "llama_cpp": {"avx512": False, "built_with": ["AVX", "AVX2"]}}
    t = llm_big._targets({**_pairs((1.2, 1.1), (1.9, 1.8)), "avx2_forced": child})
    assert t["prefill_vs_llama_cpp_2t_avx2"]["peer_avx512"] is False
    assert "peer_avx512" not in t["prefill_vs_llama_cpp_2t"]
