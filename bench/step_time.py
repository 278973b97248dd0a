"""Training-step and forward time of CPU recipes on two checkouts, interleaved (issue 27 items 3-4).

Each round runs one subprocess per checkout (``--trees name=path,...``: the
code imported is the checkout's ``keras_mone``) and recipe; each subprocess
builds the recipe's model, renders its batches, and times ``train_on_batch``
and ``predict_on_batch`` (best of 3 passes over 15 batches, after one
warm-up step). Medians over rounds; ratios against the first tree. Writes a
BENCHMARKS.md section::

    git worktree add /tmp/before <commit>
    KERAS_BACKEND=jax python bench/step_time.py --trees before=/tmp/before,after=. --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

SECTION = "## Training step of the CPU recipes: before / after (issue 27 items 3-4)"
RECIPES = ("cluttered_digits_vit", "cluttered_digits_mone")


def measure(recipe):
    """``{train_ms, predict_ms, train_sys_ms, train_faults}`` of ``recipe`` in this
    process: the system time and minor page faults are the process's, per
    training step of the timed passes (``bench/host_memory.py`` reports them)."""
    import resource
    import tempfile

    from step_profile import per_step_ms

    from keras_mone import recipes
    from keras_mone.recipes.data_sources import digits_stream

    model = recipes.load(recipe, output_dir=tempfile.mkdtemp(), epochs=1).model
    stream = digits_stream(recipes.resolve(recipe)[0])
    batches = [stream.batch(i) for i in range(16)]
    model.train_on_batch(*batches[0])
    model.predict_on_batch(batches[0][0])

    def best_ms(step):
        return min(per_step_ms(step, batches[1:]) for _ in range(3))

    before = resource.getrusage(resource.RUSAGE_SELF)
    train_ms = best_ms(lambda b: model.train_on_batch(*b))
    after = resource.getrusage(resource.RUSAGE_SELF)
    steps = 3 * len(batches[1:])
    return dict(train_ms=train_ms, predict_ms=best_ms(lambda b: model.predict_on_batch(b[0])),
                train_sys_ms=1000 * (after.ru_stime - before.ru_stime) / steps,
                train_faults=(after.ru_minflt - before.ru_minflt) / steps)


def measure_in_subprocess(recipe, env=None, cwd=None):
    """``measure(recipe)`` in a fresh process with environment ``env`` (default: this one's), run in ``cwd``."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", recipe], env=env,
                         capture_output=True, text=True, check=True, cwd=cwd).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_in(tree, recipe):
    tree = os.path.abspath(tree)
    return measure_in_subprocess(recipe, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="current=.", help="name=path,... (the first is the baseline)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    names = args.recipes.split(",")
    results = {(t, r): [] for t in trees for r in names}
    for round_index in range(args.rounds):
        for recipe in names:
            for tree, path in trees.items():
                results[(tree, recipe)].append(run_in(path, recipe))
                print(f"round {round_index + 1}: {tree} {recipe} {results[(tree, recipe)][-1]}", flush=True)
    from training_targets import write_section

    base = next(iter(trees))
    lines = [
        SECTION, "",
        f"Command: `KERAS_BACKEND={os.environ.get('KERAS_BACKEND', 'jax')} python bench/step_time.py --trees "
        f"{args.trees} --recipes {args.recipes} --rounds {args.rounds}`; batch 128; median over rounds of the best "
        "of 3 passes over 15 batches; ratios against the first checkout (the same rounds, interleaved).", "",
        "| recipe | checkout | train_on_batch ms | vs first | predict_on_batch ms | vs first |", "|---|---|---|---|---|---|",
    ]
    for recipe in names:
        ref = {k: statistics.median(r[k] for r in results[(base, recipe)]) for k in ("train_ms", "predict_ms")}
        for tree in trees:
            med = {k: statistics.median(r[k] for r in results[(tree, recipe)]) for k in ("train_ms", "predict_ms")}
            lines.append(f"| {recipe} | {tree} | {med['train_ms']:.0f} | {ref['train_ms'] / med['train_ms']:.2f}x | "
                         f"{med['predict_ms']:.1f} | {ref['predict_ms'] / med['predict_ms']:.2f}x |")
    text = "\n".join(lines) + "\n"
    write_section(text, args.benchmarks, SECTION)
    print(text)


if __name__ == "__main__":
    main()
