"""Training step and forward pass of the CPU recipes with and without huge pages for large blocks (keras_mone.host_memory).

Each round runs, per backend, recipe and setting, one subprocess started with
the setting (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, as the ``keras-mone``
command restarts itself, or the environment as it is), that builds the
recipe's model and times ``train_on_batch`` and ``predict_on_batch`` with
``bench/step_time.py``'s ``measure`` (best of 3 passes over 15 batches, with
the process's system time and minor page faults per training step). Medians over rounds; speed-ups against the default allocator of the
same round. Writes a BENCHMARKS.md section::

    python bench/host_memory.py --backends jax,tensorflow,torch --rounds 2
"""

import argparse
import os
import statistics

from step_time import RECIPES, measure_in_subprocess

SECTION = "## Host memory: huge pages for large blocks (issue 27 item 4)"
SETTINGS = ("default", "huge_pages")


def run(backend, recipe, setting):
    from keras_mone.host_memory import with_huge_pages

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"KERAS_BACKEND": backend}
    return measure_in_subprocess(recipe, env=with_huge_pages(env) if setting == "huge_pages" else env)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    backends, names = args.backends.split(","), args.recipes.split(",")
    results = {(b, r, s): [] for b in backends for r in names for s in SETTINGS}
    for round_index in range(args.rounds):
        for backend in backends:
            for recipe in names:
                for setting in SETTINGS:
                    results[(backend, recipe, setting)].append(run(backend, recipe, setting))
                    print(f"round {round_index + 1}: {backend} {recipe} {setting} "
                          f"{results[(backend, recipe, setting)][-1]}", flush=True)
    from training_targets import write_section

    keys = ("train_ms", "predict_ms", "train_sys_ms", "train_faults")
    lines = [
        SECTION, "",
        f"Command: `python bench/host_memory.py --backends {args.backends} --recipes {args.recipes} --rounds "
        f"{args.rounds}`; batch 128; per setting a fresh process (`huge_pages`: started with "
        "`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, as the `keras-mone` command restarts itself); best of 3 passes over 15 batches, median over rounds; system time "
        "and minor page faults of the process per training step; speed-ups against `default` of the same rounds.", "",
        "| backend | recipe | allocator | train_on_batch ms | speed-up | system ms / step | page faults / step "
        "| predict_on_batch ms | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for backend in backends:
        for recipe in names:
            ref = {k: statistics.median(r[k] for r in results[(backend, recipe, "default")]) for k in keys}
            for setting in SETTINGS:
                med = {k: statistics.median(r[k] for r in results[(backend, recipe, setting)]) for k in keys}
                lines.append(
                    f"| {backend} | {recipe} | {setting} | {med['train_ms']:.0f} | {ref['train_ms'] / med['train_ms']:.2f}x "
                    f"| {med['train_sys_ms']:.0f} | {med['train_faults']:.0f} | {med['predict_ms']:.1f} "
                    f"| {ref['predict_ms'] / med['predict_ms']:.2f}x |")
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)


if __name__ == "__main__":
    main()
