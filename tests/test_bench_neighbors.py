"""bench/bench_neighbors.py's explanation of the rows where faiss's ids differ from the table's:
on a small random matrix with duplicate and parallel rows (the real embedding has 15 duplicate
rows), every differing row is found equal to the float64 definition and the differences are
reported as faiss's query-not-first rows and exact float64 ties, never as a wrong table row."""

from __future__ import annotations

import re

import torch

from bench.bench_neighbors import explain_differences, faiss_ids
from megatron_ngrpo.mixing.neighbors import build_neighbor_table


def test_differences_from_faiss_are_ties_of_the_float64_definition():
    w = torch.randn(2000, 8, generator=torch.Generator().manual_seed(0))
    w[20] = w[10]  # duplicates: each ties with its twin for every query
    w[31] = w[32] = w[30]
    w[100] = 3 * w[5]  # parallel: the same cosine to every row
    table = build_neighbor_table(w, 0, 3, "cosine")
    text = explain_differences(w, table, faiss_ids(w, 3, 2000))
    assert "ours equal the float64 definition on all of them: True" in text, text
    rows = int(re.match(r"(\d+) rows differ", text).group(1))
    ties = int(re.search(r"of which (\d+) exact ties", text).group(1))
    assert rows >= 1 and 0 < ties <= rows, text
    assert re.search(r"position (\S+) \.\.", text).group(1) == "0.00e+00", text  # never < 0
    # A table row changed to faiss's order is reported as not the float64 definition.
    wrong = table.clone()
    wrong[10, 1:] = wrong[10, 1:].flip(0)
    assert "all of them: False" in explain_differences(w, wrong, faiss_ids(w, 3, 2000))
