"""A progress bar: tqdm when it is installed, else a plain one-line printer."""

import sys
import time


class PlainBar:
    """The part of tqdm's interface the trainer uses, printing at most once a second."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", disable: bool = False) -> None:
        self.total, self.n, self.desc, self.postfix = total, initial, desc, ""
        self.last_print, self.disable = 0.0, disable

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.disable:
            return
        if time.time() - self.last_print >= 1.0 or self.n == self.total:
            self.last_print = time.time()
            print(f"\r{self.desc} {self.n}/{self.total} {self.postfix}", end="", file=sys.stderr)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if not self.disable:
            print(file=sys.stderr)


def progress_bar(total: int, initial: int = 0, desc: str = "", disable: bool = False):
    """disable: no output (torchrun ranks other than 0)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainBar(total, initial, desc, disable)
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=disable)
