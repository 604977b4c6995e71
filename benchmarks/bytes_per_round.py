"""Bytes each site uploads and downloads per round, per algorithm, from the plugins' declarations.

    .venv/bin/python benchmarks/bytes_per_round.py

The declarations are what the engines validate every upload against, so these are exactly the
tensors that leave a site (float32 unless declared otherwise; the OpenFL transport adds a few
hundred bytes of framing per message). MOON's simple CNN on digits, 10 classes.
"""

from __future__ import annotations

from _results import write_section

from fedcontrast.algorithms import available_algorithms
from fedcontrast.config import RunConfig
from fedcontrast.construction import build_algorithm_with_public, initial_model, load_splits


def main() -> None:
    rows = []
    model = initial_model(RunConfig(), in_channels=1, image_size=32, num_classes=10)
    public = load_splits(RunConfig()).public  # FLESD's uploads depend on the public set's size
    variants = [(name, {}) for name in available_algorithms()]
    variants += [("flesd", {"quantize": "fp16"}), ("flesd", {"quantize": "int8"}), ("flesd", {"upload": "similarity"})]
    for name, settings in variants:
        algorithm = build_algorithm_with_public(RunConfig(algorithm=name, hyperparameters={name: settings}), public)
        if settings:
            name = f"{name} ({', '.join(f'{k}={v}' for k, v in settings.items())})"
        up = sum(s.nbytes for s in algorithm.upload_specs(model, 10))
        down = sum(s.nbytes for s in algorithm.download_specs(model, 10))
        rows.append((name, up, down))
    base = dict((n, u) for n, u, _ in rows)["fedavg"]
    lines = ["## Bytes per site per round", "", "Command: `.venv/bin/python benchmarks/bytes_per_round.py`. "
             "From the plugins' upload/download declarations (MOON's simple CNN, digits, 10 classes, "
             f"projection 256; FLESD's public set: the {len(public)} images of the digits public split).", "",
             "| algorithm | uploaded | downloaded | upload ÷ FedAvg |", "|---|---|---|---|"]
    for name, up, down in rows:
        lines.append(f"| {name} | {up:,} B | {down:,} B | {up / base:.3f} |")
        print(f"{name:32s} up {up:>9,} B  down {down:>9,} B  ÷ fedavg {up / base:.3f}")
    write_section("bytes", "\n".join(lines))


if __name__ == "__main__":
    main()
