"""`generate`'s and `chat`'s options, in process on a tiny model: each option's effect is
checked against the offline API given the same request (the engine is deterministic, so the
CLI must print exactly what `LLM` returns)."""

from __future__ import annotations

import re

import pytest

from kvserve.engine.llm import LLM
from kvserve.entrypoints import cli
from kvserve.entrypoints.cli.generate import chat_loop
from kvserve.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# The CLI's engine flags that this file sets, as `LLM` keywords for the reference.
ENGINE = {"dtype": "float32"}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.engine.close()


def generate(tiny_llama_dir, capsys, *flags: str) -> tuple[str, str]:
    rc = cli.main(["generate", *flags, "--model", str(tiny_llama_dir), "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_generate_chat_wraps_the_prompt_in_the_chat_template(tiny_llama_dir, capsys,
                                                             reference):
    out, _ = generate(tiny_llama_dir, capsys, "hello", "--chat", "--temperature", "0",
                      "--max-tokens", "6", "--ignore-eos")
    want = reference.chat([{"role": "user", "content": "hello"}],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # the answer alone: a chat prompt is not echoed
    assert out == want[0].outputs[0].text + "\n"
    plain = reference.generate("hello", SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))
    assert want[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


def test_generate_n_prints_every_sample(tiny_llama_dir, capsys, reference):
    out, err = generate(tiny_llama_dir, capsys, "hello", "--n", "3", "--temperature", "1",
                        "--seed", "7", "--max-tokens", "5", "--ignore-eos")
    want = reference.generate("hello", SamplingParams(n=3, temperature=1, seed=7,
                                                      max_tokens=5, ignore_eos=True))[0]
    texts = [c.text for c in want.outputs]
    assert len(set(texts)) > 1, "three samples at temperature 1 should not all agree"
    expected = "hello" + texts[0] + "\n" + "".join(
        f"--- sample {i} ---\n{t}\n" for i, t in enumerate(texts[1:], start=1))
    assert out == expected
    assert "finish: length, length, length" in err


def test_generate_logprobs_prints_each_tokens_top_n(tiny_llama_dir, capsys, reference):
    _, err = generate(tiny_llama_dir, capsys, "hello", "--logprobs", "2", "--temperature",
                      "0", "--max-tokens", "4", "--ignore-eos")
    want = reference.generate("hello", SamplingParams(logprobs=2, temperature=0,
                                                      max_tokens=4, ignore_eos=True))[0]
    lines = [ln for ln in err.splitlines() if " rank " in ln]
    assert len(lines) == 4
    for line, lp in zip(lines, want.outputs[0].logprobs, strict=True):
        m = re.fullmatch(r"  (.+) (-?\d+\.\d{3}) rank (\d+) \[(.*)\]", line)
        assert m, line
        assert float(m[2]) == pytest.approx(lp.logprob, abs=5e-4)
        assert int(m[3]) == lp.rank == 1  # greedy: the chosen token is the top one
        tops = re.findall(r"(-?\d+\.\d{3})(?:, |$)", m[4])
        assert [float(t) for t in tops] == pytest.approx([p for _, p in lp.top], abs=5e-4)
        assert len(tops) == 2


class RecordingEngine:
    """The engine `chat` talks to, recording the prompt of every request."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    def add_request(self, rid, prompt, params, **kw):
        self.prompts.append(list(prompt))
        return self.engine.add_request(rid, prompt, params, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_chat(monkeypatch, capsys, reference, flags: list[str], lines: list[str]):
    args = cli.build_parser().parse_args(["chat", *flags, "--temperature", "0",
                                          "--max-tokens", "5", "--ignore-eos"])
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    engine = RecordingEngine(reference.engine)
    assert chat_loop(engine, args) == 0
    return engine.prompts, capsys.readouterr().out


def test_chat_keeps_the_conversation_and_reset_clears_it(monkeypatch, capsys, reference):
    prompts, out = run_chat(monkeypatch, capsys, reference, ["--system", "be brief"],
                            ["hi", "more", "/reset", "", "hi", "/exit", "never read"])
    assert len(prompts) == 3  # the blank line and the commands make no request
    first = reference.chat([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hi"}],
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert prompts[0] == prompts[2] == list(first.prompt_token_ids)
    # the second turn carries the first: system, question, the model's answer, question
    second = reference.render_chat([
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "more"}])
    assert prompts[1] == second
    reply = reference.generate(second, SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))[0].outputs[0].text
    a = first.outputs[0].text
    assert out == f"{a}\n{reply}\n{a}\n"


def test_chat_without_a_system_message_resets_to_nothing(monkeypatch, capsys, reference):
    prompts, _ = run_chat(monkeypatch, capsys, reference, [], ["hi", "/reset", "hi"])
    assert prompts[0] == prompts[1] == reference.render_chat([{"role": "user",
                                                                "content": "hi"}])


def test_train_mtp_saves_a_drafter_that_serves(tiny_llama_dir, tmp_path, capsys, reference):
    """`kvserve train-mtp` on a tiny model, briefly: the module it saves loads as an MTP
    drafter, and greedy output with it is the output without it (drafts are only verified)."""
    out_path = tmp_path / "mtp.safetensors"
    rc = cli.main(["train-mtp", "--model", str(tiny_llama_dir), "--output", str(out_path),
                   "--num-prompts", "16", "--max-tokens", "8", "--epochs", "1",
                   "--batch-size", "32", "--draft-vocab", "0", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"saved {out_path}:" in out and '"method": "mtp"' in out
    # Drafting every step (a briefly trained module drafts badly, and the adaptive policy
    # would soon stop it): every draft is verified, and the output must not change.
    spec = LLM(str(tiny_llama_dir), **ENGINE,
               speculative_config={"method": "mtp", "model": str(out_path),
                                   "num_speculative_tokens": 2, "adaptive_depth": False,
                                   "min_acceptance": 0.0})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["hello", "abc abc abc"]
    try:
        want = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
        outs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # the drafter did draft
    finally:
        spec.engine.close()


def test_train_mtp_reads_a_prompt_file_and_reuses_its_generations(tiny_llama_dir, tmp_path,
                                                                  monkeypatch, capsys):
    """--prompts trains on the user's prompts (a tenth held out) and --generations writes the
    target's answers once, then reads them back instead of generating again."""
    from kvserve.tools import train_mtp as tm

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(20)) + "\n")
    gens = tmp_path / "gens.json"
    asked: list[list[str]] = []
    real_generate = tm._generate

    def generate(llm, texts, *a):
        asked.append(list(texts))
        return real_generate(llm, texts, *a)

    monkeypatch.setattr(tm, "_generate", generate)
    argv = ["train-mtp", "--model", str(tiny_llama_dir), "--prompts", str(prompts),
            "--generations", str(gens), "--max-tokens", "6", "--epochs", "1",
            "--batch-size", "16", "--draft-vocab", "0", "--intermediate", "32",
            "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path / "a.safetensors")]) == 0
    assert len(asked) == 1 and sorted(asked[0]) == sorted(f"question {i}" for i in range(20))
    assert "on answers to held-out prompts" in capsys.readouterr().out
    assert gens.is_file()
    saved = tm.read_generations(gens, 10 ** 6)
    assert len(saved[0]) == 20 and saved[2] == 18  # 2 of 20 held out
    assert cli.main([*argv, "--output", str(tmp_path / "b.safetensors")]) == 0
    assert len(asked) == 1  # the second run read them
    assert (tmp_path / "b.safetensors").is_file()


def test_train_mtp_refuses_bad_prompt_and_generation_files(tiny_llama_dir, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": 3}\n')
    assert cli.main(["train-mtp", "--model", str(tiny_llama_dir), "--prompts", str(bad)]) == 2
    assert f'{bad}:2: expected a string or {{"prompt": "..."}}' in capsys.readouterr().err
    one = tmp_path / "one.txt"
    one.write_text("only one\n\n")
    assert cli.main(["train-mtp", "--model", str(tiny_llama_dir), "--prompts", str(one)]) == 2
    assert "at least 2 prompts" in capsys.readouterr().err
    gens = tmp_path / "g.json"
    gens.write_text('{"format": "kvserve-mtp-generations-v1", "train": 1, "prompt_lens": [1, 1],'
                    ' "sequences": [[1, 2], [3, 99999999]]}')
    assert cli.main(["train-mtp", "--model", str(tiny_llama_dir), "--generations",
                     str(gens)]) == 2
    assert "not generations written by `kvserve train-mtp --generations`" in \
        capsys.readouterr().err
    assert cli.main(["train-mtp", "--prompts", str(tmp_path / "none.txt"),
                     "--no-download"]) == 2
    assert "--prompts: no such file" in capsys.readouterr().err


def test_the_built_in_prompts_hold_out_whole_topics_and_tasks():
    from kvserve.tools.train_mtp import prompt_sets

    train, val = prompt_sets(400, seed=1)
    assert len(train) == 400 and len(val) == 40
    assert not set(train) & set(val)
    assert any(t.startswith("Write a Python function") for t in train)


@pytest.mark.parametrize("flag", ["--num-prompts", "--epochs"])
def test_train_mtp_refuses_a_count_below_one(flag, capsys):
    assert cli.main(["train-mtp", flag, "0", "--no-download"]) == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err
