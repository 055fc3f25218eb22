"""Training prompts closer to Spec-Bench's tasks than the default mix, none taken from an evaluation set.

The default corpus (`train_prompts.jsonl`, prompts of at most 384 tokens) is mostly short chat and code
requests. Spec-Bench also asks for grade-school math, and for summaries of and answers about long passages,
where much of the answer is copied from the prompt. This writes, in the normalized format
({id, category, turns}):

- `gsm8k_train/<line>`: questions of the GSM8K *train* split (Spec-Bench's math items come from its test split);
- `long/<id>`: training prompts longer than the default corpus allowed (its generation skipped them);
- `summarize/<id>`: "Summarize: " followed by a long prose training prompt (Spec-Bench's summarization
  prompts have this form; the passages here are user texts from the training sources, not news articles);
- `question/<id>` (`--questions N`): the first N short factual questions among the training prompts (who, what,
  when, where, which, how many/much; at most 16 words, ending in '?'), nearer Spec-Bench's Natural Questions
  items than the instruction mix around them;
- `copy/<template>/<id>` (`--copies N`): requests whose answer copies from the prompt, the target's most
  common behaviour on Spec-Bench's translation, summarization and RAG items, which the drafter trained
  on the above rarely learned (it fails even in the target's repetition loops). N prompts cycling
  through COPY_TEMPLATES, each with prose from a training prompt: one to three sentences for the
  translation form (the shared data hold almost no German, so the sentences are English, and the target
  mostly repeats them), a paragraph for the others.

`--exclude` keeps trained prompts out of the long, summary and question rows; `--only CATEGORY ...` keeps
only those categories, and `--drop-made CORPUS ...` drops every row whose own id a corpus already holds
(e.g. the rows of an earlier, larger build that a later corpus generated).

Usage: .venv/bin/python scripts/build_targeted_prompts.py OUT.jsonl [--gsm8k N] [--summaries N] [--copies N]
       [--questions N] [--no-long] [--exclude CORPUS ...] [--only CATEGORY ...] [--drop-made CORPUS ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

from hspec.data.tasks import data_file
from hspec.training.datagen import read_corpus, read_prompts

LONG_PROMPT_CHARS = 1300  # ~330 tokens: shorter prompts were already eligible for the default corpus
MAX_PROMPT_CHARS = 4000  # ~1,000 tokens: the generation's --max-prompt-tokens 1024 drops the rest
CODE_CHARACTERS = set("{}[];=<>_/\\|`$#")
QUESTION = re.compile(r"^(who|what|when|where|which|how many|how much|in what|what year)\b", re.IGNORECASE)
QUESTION_MAX_WORDS = 16


COPY_TEMPLATES = {
    "translate": "Translate German to English: {sentences}",
    "repeat": "Repeat the following text exactly, word for word:\n\n{paragraph}",
    "proofread": "Fix the grammar and spelling of the following text:\n\n{paragraph}",
    "passage_qa": "Answer the question using the passage.\n\nPassage: {paragraph}\n\nQuestion: What is the "
                  "passage mainly about?",
}
COPY_PARAGRAPH_CHARS = 1200  # ~300 tokens


def _sentences(text: str, rng: random.Random) -> str:
    """One to three consecutive sentences of `text` (split at '. ')."""
    parts = [p.strip() for p in text.replace("\n", " ").split(". ") if len(p.strip()) > 20]
    if not parts:
        return text[:200]
    start = rng.randrange(len(parts))
    picked = parts[start:start + rng.randint(1, 3)]
    return ". ".join(picked).rstrip(".") + "."


def copy_prompts(prose: list[dict], count: int, rng: random.Random) -> list[dict]:
    """`count` prompts cycling through COPY_TEMPLATES, each over a different prose prompt."""
    rows = []
    templates = list(COPY_TEMPLATES.items())
    for i, r in enumerate(rng.sample(prose, min(count, len(prose)))):
        name, template = templates[i % len(templates)]
        text = r["turns"][0]
        turn = template.format(sentences=_sentences(text, rng), paragraph=text[:COPY_PARAGRAPH_CHARS])
        rows.append({"id": f"copy/{name}/{r['id']}", "category": f"copy_{name}", "turns": [turn]})
    return rows


def _is_prose(text: str) -> bool:
    """Mostly letters and spaces, few characters typical of code or markup."""
    code = sum(ch in CODE_CHARACTERS for ch in text)
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return code / len(text) < 0.01 and letters / len(text) > 0.9


def is_short_question(text: str) -> bool:
    """A short factual question: a wh-word first, at most QUESTION_MAX_WORDS words, a '?' last."""
    text = text.strip()
    return bool(QUESTION.match(text)) and len(text.split()) <= QUESTION_MAX_WORDS and text.endswith("?")


def build(gsm8k_count: int, summary_count: int, excluded_ids: set[str], seed: int = 0,
          copy_count: int = 0, long_prompts: bool = True, question_count: int = 0) -> list[dict]:
    rng = random.Random(seed)
    with gzip.open(data_file("gsm8k_train.jsonl"), "rt", encoding="utf-8") as f:  # shipped in hspec/data
        gsm8k = [json.loads(line) for line in f if line.strip()]
    picked = rng.sample(range(len(gsm8k)), gsm8k_count)
    rows = [{"id": f"gsm8k_train/{i}", "category": "math", "turns": [gsm8k[i]["question"]]} for i in picked]

    train = read_prompts(data_file("train_prompts.jsonl"))
    long_rows = [r for r in train if LONG_PROMPT_CHARS < len(r["turns"][0]) <= MAX_PROMPT_CHARS
                 and r["id"] not in excluded_ids]
    if long_prompts:
        rows += [{"id": f"long/{r['id']}", "category": "long", "turns": r["turns"]} for r in long_rows]
    prose = [r for r in long_rows if _is_prose(r["turns"][0])]
    for r in rng.sample(prose, min(summary_count, len(prose))):
        rows.append({"id": f"summarize/{r['id']}", "category": "summarize",
                     "turns": ["Summarize: " + r["turns"][0]]})
    if copy_count:  # drawn from all prose prompts, so a later --copies run needs no --exclude
        all_prose = [r for r in train if len(r["turns"][0]) > 300 and _is_prose(r["turns"][0])]
        rows += copy_prompts(all_prose, copy_count, random.Random(seed + 1))
    questions = [r for r in train if r["id"] not in excluded_ids and is_short_question(r["turns"][0])]
    rows += [{"id": f"question/{r['id']}", "category": "question", "turns": r["turns"][:1]}
             for r in questions[:question_count]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output JSONL (normalized prompt format)")
    parser.add_argument("--gsm8k", type=int, default=320, help="GSM8K train questions (default 320)")
    parser.add_argument("--summaries", type=int, default=200, help="'Summarize:' prompts (default 200)")
    parser.add_argument("--copies", type=int, default=0,
                        help="prompts whose answer copies from the prompt (default 0; see COPY_TEMPLATES)")
    parser.add_argument("--questions", type=int, default=0,
                        help="short factual questions from the training prompts (default 0)")
    parser.add_argument("--long", action=argparse.BooleanOptionalAction, default=True,
                        help="include the long training prompts (default yes)")
    parser.add_argument("--exclude", type=Path, nargs="*", default=[],
                        help="corpus JSONL files whose prompts are left out (already trained on)")
    parser.add_argument("--only", nargs="*", default=None, metavar="CATEGORY", help="keep only these categories")
    parser.add_argument("--drop-made", type=Path, nargs="*", default=[], metavar="CORPUS",
                        help="drop the rows whose ids these corpus JSONL files hold (generated already)")
    args = parser.parse_args()
    excluded = {record["id"] for path in args.exclude for record in read_corpus(path)}
    rows = build(args.gsm8k, args.summaries, excluded, copy_count=args.copies, long_prompts=args.long,
                 question_count=args.questions)
    made = {record["id"] for path in args.drop_made for record in read_corpus(path)}
    rows = [r for r in rows if (args.only is None or r["category"] in args.only) and r["id"] not in made]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    counts = {c: sum(r["category"] == c for r in rows) for c in dict.fromkeys(r["category"] for r in rows)}
    print(f"wrote {len(rows)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
