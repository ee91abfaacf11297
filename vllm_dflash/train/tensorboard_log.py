"""Training scalars in a tensorboard event file (`vllm-dflash train --tensorboard DIR`).

Rank 0 writes one point per optimizer step of the train loss, the learning rate the step used,
its block tokens per second and, per mask position k = 1..B-1, the fraction of the step's blocks
whose greedy token (argmax of the logits) is the label; and one point per epoch of the eval
acceptance length, at the epoch's last step.
"""

INSTALL_FIX = "pip install tensorboard"
LOSS = "train/loss"
LR = "train/lr"
TOKENS_PER_S = "train/block_tokens_per_s"
ACCEPTANCE_LENGTH = "eval/acceptance_length"


def accuracy_tag(k: int) -> str:
    """The tag of mask position k's accuracy (zero-padded: tensorboard sorts tags as text)."""
    return f"accuracy/position_{k:02d}"


class Board:
    """A SummaryWriter of log_dir with the trainer's scalars."""

    def __init__(self, log_dir: str) -> None:
        try:
            # Imported here: tensorboard is needed only with --tensorboard.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f"--tensorboard {log_dir} needs the tensorboard package, which is not "
                f"installed; fix: {INSTALL_FIX}, or drop --tensorboard"
            ) from err
        self.writer = SummaryWriter(log_dir)

    def add_step(
        self, step: int, loss: float, lr: float, tokens_per_s: float, accuracy: list[float]
    ) -> None:
        """The scalars of optimizer step `step`; accuracy[k-1]: mask position k's."""
        scalars = {LOSS: loss, LR: lr, TOKENS_PER_S: tokens_per_s}
        scalars |= {accuracy_tag(k): value for k, value in enumerate(accuracy, start=1)}
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def add_acceptance_length(self, step: int, tau: float) -> None:
        self.writer.add_scalar(ACCEPTANCE_LENGTH, tau, step)

    def close(self) -> None:
        """Flushes the event file."""
        self.writer.close()
