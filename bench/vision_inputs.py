"""``python -m bench.vision_inputs``: the front end's image preprocessing (``multimodal/qwen2_vl.py``,
Pillow + numpy) against transformers' ``Qwen2VLImageProcessorPil`` on the same images, and our
vision tower against transformers' on the same random weights (Qwen2.5-VL-3B's vision width, 4
blocks instead of 32, on the smallest image), each pair timed side by side in this one run; prints the ratios.

Nothing is downloaded: the images are synthetic, the tower's weights random (fp32, CPU).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np


def _pair(ours: Callable[[], object], theirs: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` runs of each, in seconds, the two alternating (after one warm-up
    each), so a busy machine slows both alike."""
    ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def main(argv: list[str] | None = None) -> None:
    import torch
    from PIL import Image
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from inflight.runtime.model.qwen2_5_vl_vision import VisionTower
    from inflight.runtime.multimodal.qwen2_vl import ImageProcessing

    parser = argparse.ArgumentParser(prog="python -m bench.vision_inputs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4, help="vision blocks (Qwen2.5-VL-3B has 32)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    ours, theirs = ImageProcessing(), Qwen2VLImageProcessorPil()
    print(f"{'image':>10} {'tokens':>7} {'ours ms':>8} {'transformers ms':>16} {'ratio':>6}")
    items = []
    for width, height in ((640, 480), (1280, 720), (1920, 1080)):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        a, b = _pair(lambda image=image: ours.preprocess(image),
                     lambda image=image: theirs(images=[image], return_tensors="np"), args.repeats)
        items.append(ours.preprocess(image))
        print(f"{width}x{height:<5} {items[-1].num_tokens:>7} {a * 1e3:>8.1f} {b * 1e3:>16.1f} {b / a:>6.2f}")
    vision = Qwen2_5_VLConfig(vision_config={"depth": args.depth, "hidden_size": 1280, "intermediate_size": 3420,
                                             "num_heads": 16, "out_hidden_size": 2048,
                                             "fullatt_block_indexes": [args.depth - 1]}).vision_config  # fmt: skip
    torch.manual_seed(0)
    reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision).eval()
    tower = VisionTower(vision)
    tower.load_state_dict(reference.state_dict())
    print(f"\nvision tower ({args.depth} blocks of Qwen2.5-VL-3B's width), fp32 CPU, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'image':>10} {'ours ms':>8} {'transformers ms':>16} {'ratio':>6} {'max |diff|':>11}")
    with torch.inference_mode():
        for item in items[:1]:
            pixels, grid = torch.from_numpy(item.pixel_values), [item.grid_thw]
            a, b = _pair(lambda pixels=pixels, grid=grid: tower(pixels, grid),
                         lambda pixels=pixels, grid=grid: reference(pixels, grid_thw=torch.tensor(grid)),
                         max(1, args.repeats // 2))  # fmt: skip
            diff = (tower(pixels, grid) - reference(pixels, grid_thw=torch.tensor(grid)).pooler_output).abs().max()
            h, w = item.grid_thw[1] * 14, item.grid_thw[2] * 14
            print(f"{w}x{h:<5} {a * 1e3:>8.1f} {b * 1e3:>16.1f} {b / a:>6.2f} {float(diff):>11.2e}")


if __name__ == "__main__":
    main()
