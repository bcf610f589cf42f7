"""Fine-tune a tiny, randomly initialised Llama on synthetic tokens through mindformers' Trainer.

Runs on CPU in graph mode in about a minute. The script itself knows nothing of mfotel: launch it
through `mfotel-instrument`, which registers OTelMonitor and the CPU train cell that the YAML
names before the Trainer builds them:

    cd "$(mktemp -d)"        # mindformers writes ./output/ under the working directory
    mfotel-instrument python /path/to/examples/mindformers/run_tiny_llama.py \
        --config /path/to/examples/mindformers/tiny_llama_cpu.yaml

Same steps as mindformers' run_mindformer.py (which is not in the wheel): load the config (which
applies mindformers' template), set the output path, build the context (else the run is
PyNative, ~1 s a step), train.
"""
from __future__ import annotations

import argparse

import numpy as np
from mindformers import MindFormerConfig, Trainer
from mindformers.core.context import build_context
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindformers.utils.file_utils import set_output_path
from mindspore.dataset import GeneratorDataset


class SyntheticTokens:
    """Random-access token rows with a learnable rule (x[t+1] = (a*x[t] + b) mod vocab).

    Random access (`__getitem__`), not a generator: mindformers shards datasets across ranks.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        rows = np.empty((num_samples, seq_length), dtype=np.int32)
        rows[:, 0] = rng.integers(3, vocab_size, num_samples)
        steps = rng.choice([1, 3, 5, 7], size=num_samples)
        for t in range(1, seq_length):
            rows[:, t] = (rows[:, t - 1] * 5 + steps) % vocab_size
        self.rows = rows

    def __getitem__(self, index: int) -> tuple[np.ndarray]:
        return (self.rows[index],)

    def __len__(self) -> int:
        return len(self.rows)


@MindFormerRegister.register(MindFormerModuleType.DATASET_LOADER)
class SyntheticTokenDataLoader:
    """`train_dataset.data_loader.type: SyntheticTokenDataLoader`; mindformers adds the shard
    info."""

    def __new__(cls, column_names: list[str], num_samples: int = 40, seq_length: int = 65,
                vocab_size: int = 256, seed: int = 0, shuffle: bool = False,
                num_shards: int | None = None, shard_id: int | None = None, **_: object):
        return GeneratorDataset(SyntheticTokens(num_samples, seq_length, vocab_size, seed),
                                column_names=list(column_names), shuffle=shuffle,
                                num_shards=num_shards, shard_id=shard_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="mindformers YAML")
    parser.add_argument("--steps", type=int, default=None,
                        help="train this many steps (overrides data_loader.num_samples)")
    args = parser.parse_args()

    config = MindFormerConfig(args.config)
    if args.steps is not None:
        config.train_dataset.data_loader.num_samples = args.steps * config.train_dataset.batch_size
    set_output_path(config.output_dir)
    build_context(config)
    Trainer(config).train()


if __name__ == "__main__":
    main()
