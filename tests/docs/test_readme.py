"""The README runs as written and says what it links to.

* Size: at most 12 KB (the first screen is what a newcomer reads).
* Every fenced block is ``python`` or ``bash``. Every ``python`` block is executed on CPU with a tiny checkpoint
  saved under its Hub id and tiny datasets for the ones it loads (doc_blocks.py), with only these changes: a
  TRL config gets one short CPU step in fp32 (``doc_blocks.FAST_TRL``); ``transformers.TrainingArguments``
  gets the README's CPU settings (``use_cpu=True``; the bf16 model is loaded in float32) and two steps;
  ``trainer.train()`` runs under a hook on lm_head that checks hf_fused computed the loss and no
  ``[tokens, vocab]`` logits were built.
* Every ``bash`` line is a command whose pieces exist: a ``pip install`` names extras that setup.cfg defines,
  ``make`` a target of the Makefile, ``accelerate launch`` an accelerate config and a script of the repository
  and only options the script's ``--help`` lists.
* Every relative link resolves; a link into ``docs/reference/`` names an anchor that the page's
  ``::: identifier`` directives generate, a link into another page an anchor of one of its headings (the docs
  pages' own links are the strict site build's: ``validation: anchors``); every public entry point
  (``hf_fused.__all__``) is linked to its reference page.
"""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
import sys

import pytest

import hf_fused
from doc_blocks import (ROOT, assert_fused_training, fast_trl, fenced_blocks, hub_ids, python_blocks,
                        train_watching_lm_head)
from models import WORD_VOCAB

README = ROOT / "README.md"


def _readme() -> str:
    return README.read_text()


def test_readme_is_at_most_12_kb():
    assert len(README.read_bytes()) <= 12 * 1024, f"README.md is {len(README.read_bytes())} bytes"


def test_every_block_is_python_or_bash():
    languages = [lang for lang, _ in fenced_blocks(_readme())]
    assert languages and set(languages) <= {"python", "bash"}, languages
    assert "python" in languages and "bash" in languages


def _cpu(block: str) -> str:
    """The README's CPU settings for a ``transformers.Trainer`` block (and two steps); TRL blocks: FAST_TRL."""
    if "TrainingArguments(" in block:
        assert block.count('dtype="bfloat16"') == 1 and block.count('TrainingArguments("out", ') == 1, block
        block = block.replace('dtype="bfloat16"', 'dtype="float32"').replace(
            'TrainingArguments("out", ',
            'TrainingArguments("out", use_cpu=True, max_steps=2, per_device_train_batch_size=2, report_to=[], ')
    return fast_trl(block)


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_python_block_runs_with_hf_fused(index, offline_hub):
    block = python_blocks(_readme())[index]
    assert len(re.findall(r"^trainer\.train\(\)", block, flags=re.M)) == 1, "each block ends in one trainer.train()"
    offline_hub(*hub_ids(block))
    namespace: dict = {}
    setup = re.sub(r"^trainer\.train\(\).*$", "", _cpu(block), flags=re.M)
    exec(compile(setup, f"README.md python block {index}", "exec"), namespace)
    trainer = namespace["trainer"]
    assert hf_fused.is_fused(trainer.model)
    assert_fused_training(train_watching_lm_head(trainer), WORD_VOCAB)
    assert trainer.state.global_step >= 1


# -- shell commands -------------------------------------------------------------------------------------------


def _commands() -> list[list[str]]:
    commands = []
    for lang, body in fenced_blocks(_readme()):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def _extras() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return set(config["options.extras_require"])


def _check_pip(argv: list[str]) -> None:
    assert argv[:2] == ["pip", "install"], argv
    for spec in argv[2:]:
        for extras in re.findall(r"hf_fused\[([^\]]+)\]", spec):
            assert set(extras.split(",")) <= _extras(), (spec, _extras())


def _check_make(argv: list[str]) -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert set(argv[1:]) <= targets, (argv, targets)


def _check_accelerate(argv: list[str]) -> None:
    assert argv[:2] == ["accelerate", "launch"] and argv[2] == "--config_file", argv
    config, script, options = ROOT / argv[3], ROOT / argv[4], [a for a in argv[5:] if a.startswith("--")]
    assert config.is_file() and script.is_file(), (config, script)
    help_text = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                               timeout=300).stdout
    for option in options:
        assert re.search(rf"{re.escape(option)}\b", help_text), f"{script.name} --help lists no {option}"


def test_every_shell_command_names_what_exists():
    commands = _commands()
    kinds = {argv[0] for argv in commands}
    assert {"pip", "make", "accelerate"} <= kinds, kinds
    for argv in commands:
        {"pip": _check_pip, "make": _check_make, "accelerate": _check_accelerate}[argv[0]](argv)


# -- links ----------------------------------------------------------------------------------------------------


def _links() -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _readme())


def _reference_anchors(page: str) -> set[str]:
    return set(re.findall(r"^:::\s+(\S+)", (ROOT / page).read_text(), flags=re.M))


def _heading_anchors(page: str) -> set[str]:
    """The anchors of a page's headings as the site's table of contents makes them (Python-Markdown's ``slugify`` of
    the heading's text without its inline markup; GitHub's agree for these headings), code blocks left out."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.S | re.M)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)
    return {slugify(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h).replace("`", "").replace("*", ""), "-")
            for h in headings}


def test_every_relative_link_resolves():
    for link in _links():
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), link
        if path.startswith("docs/reference/") and anchor:
            assert anchor in _reference_anchors(path), f"{link}: no '::: {anchor}' on {path}"
        elif path.endswith(".md") and anchor:
            assert anchor in _heading_anchors(path), f"{link}: no heading with that anchor on {path}"


def test_every_public_entry_point_links_to_its_reference():
    import hf_fused.ops

    linked = {link.partition("#")[2] for link in _links() if link.startswith("docs/reference/")}
    for name in hf_fused.__all__:
        public = {f"hf_fused.{name}"}
        if name in hf_fused.ops.__all__:
            public.add(f"hf_fused.ops.{name}")
        assert public & linked, f"the README links hf_fused.{name} to no reference page"
