"""The qwen2.5-vl-7b shape directory (pagedllm/benchmarks/shapes.py): transformers reads its config, tokenizer and
image processor as Qwen2.5-VL-7B-Instruct's; shrunk to a tiny size it serves an image chat request with dummy
weights; benchmarks/vl_hf_bench.py builds and runs its requests."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import pytest

from pagedllm.benchmarks.shapes import write_shape_dir
from tests.utils import tiny_image

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
    "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}  # fmt: skip


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory) -> str:
    return write_shape_dir("qwen2.5-vl-7b", tmp_path_factory.mktemp("shapes") / "qwen2.5-vl-7b")


def _shrink(src: str, dst: Path) -> str:
    """``src`` with a tiny text model and vision tower (same special ids, vocabulary and processor files)."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    mrope = [2, 3, 3]  # head_dim 16: 8 rotary pairs
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, max_window_layers=2)  # fmt: skip
    text["rope_parameters"]["mrope_section"] = mrope
    config["vision_config"].update(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                                   fullatt_block_indexes=[1])  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def smart_resize_tokens(height: int, width: int, factor: int = 28) -> int:
    """Qwen2-VL's image token count for an image within its pixel limits: each side rounded to a multiple of
    ``factor`` (patch 14 x merge 2), one token per ``factor x factor`` unit."""
    return round(height / factor) * round(width / factor)


def test_config_tokenizer_and_processor(shape_dir: str) -> None:
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(shape_dir)
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        3584, 28, 28, 4
    )  # fmt: skip
    assert (text.intermediate_size, text.vocab_size, text.max_position_embeddings) == (18944, 152064, 128000)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.rope_parameters["rope_theta"] == 1e6
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads) == (32, 1280, 3420, 16)
    assert (vision.out_hidden_size, vision.patch_size, vision.spatial_merge_size, vision.window_size) == (
        3584, 14, 2, 112
    )  # fmt: skip
    assert vision.fullatt_block_indexes == [7, 15, 23, 31]
    assert (config.image_token_id, config.video_token_id) == (151655, 151656)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (151652, 151653)

    tok = AutoTokenizer.from_pretrained(shape_dir)
    assert len(tok) == 152064
    assert {t: tok.convert_tokens_to_ids(t) for t in QWEN_IDS} == QWEN_IDS
    assert tok.eos_token_id == 151645
    messages = [{"role": "user", "content": [{"type": "text", "text": "w10 w11"}, {"type": "image"}]}]
    text_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text_prompt.endswith(
        "<|im_start|>user\nw10 w11<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text_prompt, add_special_tokens=False)["input_ids"]
    assert 0 not in ids  # every word of the template is in the vocabulary (no <unk>)

    from PIL import Image

    processor = AutoImageProcessor.from_pretrained(shape_dir)
    grid = processor(images=[Image.new("RGB", (1024, 768))], return_tensors="np")["image_grid_thw"]
    assert grid.tolist() == [[1, 54, 74]]  # 768 x 1024 -> 756 x 1036 pixels: 54 x 74 patches of 14
    assert int(grid.prod()) // 4 == smart_resize_tokens(768, 1024) == 999


def test_auto_processor_expands_the_image(shape_dir: str) -> None:
    """Qwen2.5-VL's processor (what vLLM loads) turns one 1024x768 image into 999 ``<|image_pad|>`` tokens."""
    pytest.importorskip("torchvision")  # its video processor needs it
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(shape_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", (1024, 768))], return_tensors="np")
    assert int((out["input_ids"] == QWEN_IDS["<|image_pad|>"]).sum()) == smart_resize_tokens(768, 1024)


def test_tiny_copy_serves_an_image_chat_with_dummy_weights(shape_dir: str, tmp_path) -> None:
    from pagedllm import LLM, SamplingParams

    path = _shrink(shape_dir, tmp_path / "tiny")
    image = tiny_image(5, (112, 84))  # 84 x 112 pixels: 3 x 4 merged units
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "w7 w8"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(path, load_format="dummy", device="cpu", dtype="float32", max_model_len=256, enforce_eager=True,
             limit_mm_per_prompt={"image": 1}) as llm:  # fmt: skip
        out = llm.chat(messages, params, use_tqdm=False)[0]
        stats = llm.llm_engine.engine_core.scheduler.make_stats()
    assert out.prompt_token_ids.count(QWEN_IDS["<|image_pad|>"]) == smart_resize_tokens(84, 112) == 12
    assert out.prompt_token_ids[:1] == [QWEN_IDS["<|im_start|>"]]
    assert len(out.outputs[0].token_ids) == 5
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (1, 0)


def _load_hf_bench():
    spec = importlib.util.spec_from_file_location("vl_hf_bench", REPO_ROOT / "benchmarks" / "vl_hf_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_bench_requests_and_a_smoke_run(shape_dir: str, tmp_path, monkeypatch, capsys) -> None:
    """The transformers baseline builds bench serve's random-mm requests (one image mark each, expanded to the
    image's tokens, left padded) and runs end to end on a tiny copy."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    bench = _load_hf_bench()
    tok = AutoTokenizer.from_pretrained(shape_dir)
    requests = bench.build_requests(tok, 3, 16, 4, width=112, height=84, seed=0)
    assert len(requests) == 3 and all(text.count("<|image_pad|>") == 1 for text, _ in requests)
    assert all(url.startswith("data:image/jpeg;base64,") for _, url in requests)
    config = AutoConfig.from_pretrained(shape_dir)
    inputs = bench.prepare_batch(tok, AutoImageProcessor.from_pretrained(shape_dir), config, requests)
    pads = (inputs["input_ids"] == QWEN_IDS["<|image_pad|>"]).sum(-1)
    assert pads.tolist() == [12, 12, 12] and inputs["image_grid_thw"].tolist() == [[1, 6, 8]] * 3
    assert inputs["attention_mask"][:, -1].all()  # left padding: every row ends with its last token
    assert inputs["mm_token_type_ids"].sum() == 36

    path = _shrink(shape_dir, tmp_path / "tiny")
    argv = ["vl_hf_bench.py", "--model", path, "--num-prompts", "3", "--batch-size", "2", "--input-len", "8",
            "--output-len", "3", "--image-size", "112x84"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 3 and result["request_throughput"] > 0
    assert 0 < result["p50_ttft_ms"] <= result["p50_e2el_ms"]
    assert math.isfinite(result["mean_tpot_ms"])
