"""Write the synthetic chat data shipped in examples/chat/ (deterministic: rerun to rebuild).

    python examples/chat/make_synthetic.py            # rewrites the four files beside this script

* ``sft.jsonl``: short conversations ``{"messages": [...]}`` — greetings, facts from small
  tables, word games and GSM8K-style addition problems (the user turn carries lmforge's GSM8K
  instruction, the reply ends in ``#### N``) so that a tiny pretrained model learns the chat
  format and the answer format the RL stage rewards.
* ``preferences.jsonl``: ``{"prompt", "chosen", "rejected"}`` pairs (a right, polite answer
  against a wrong or curt one) for ``lmforge dpo``.
* ``arithmetic-train.jsonl`` / ``arithmetic-test.jsonl``: GSM8K-format problems
  ``{"question", "answer": "... #### N"}`` for ``lmforge rl --task gsm8k`` (disjoint sets).

Everything here is made up by this script; it is the project's own data (examples/README.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# lmforge.posttrain.tasks.GSM8K_INSTRUCTION, repeated so this script runs without lmforge
GSM8K_INSTRUCTION = " Think step by step, then give the final answer after '####'."

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Peru": "Lima", "Norway": "Oslo", "Greece": "Athens", "Poland": "Warsaw",
    "Ireland": "Dublin", "Portugal": "Lisbon", "Austria": "Vienna", "Chile": "Santiago",
}  # fmt: skip
COLOURS = {
    "grass": "green", "the sky": "blue", "snow": "white", "coal": "black",
    "a banana": "yellow", "a tomato": "red", "an orange": "orange", "a plum": "purple",
}  # fmt: skip
ANIMALS = {
    "dog": "barks", "cat": "meows", "cow": "moos", "duck": "quacks",
    "lion": "roars", "sheep": "bleats", "owl": "hoots", "horse": "neighs",
}  # fmt: skip
WORDS = ("cat", "tree", "house", "river", "apple", "light", "stone", "bread", "cloud", "music",
         "garden", "window", "pencil", "forest", "summer", "winter", "letter", "bottle")  # fmt: skip
MAX_OPERAND = 9  # one-digit operands: a 1M-parameter model can learn them, so RL has a signal
GREETINGS = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What would you like to talk about?"),
    ("Good morning!", "Good morning! How can I help?"),
    ("Thank you.", "You are welcome!"),
    ("Thanks a lot!", "Glad I could help."),
    ("Who are you?", "I am a small language model trained with lmforge."),
    ("What can you do?", "I can answer simple questions, add numbers and play word games."),
    ("Goodbye!", "Goodbye! Have a nice day."),
)


def addition(rng: random.Random, max_value: int) -> tuple[str, str, int]:
    """(question, worked answer ending in ``#### N``, N) of a small addition problem."""
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"What is {a} + {b}?"
    elif kind == 1:
        q = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
    else:
        q = f"A box holds {a} pens and another holds {b}. How many pens are there in all?"
    return q, f"{a} + {b} = {a + b}.\n#### {a + b}", a + b


def chat(rng: random.Random, held_out: set[str]) -> list[dict[str, str]]:
    """One conversation of a randomly chosen kind (no addition whose question is ``held_out``)."""
    kind = rng.randrange(6)
    if kind == 0:
        u, a = rng.choice(GREETINGS)
    elif kind == 1:
        country = rng.choice(sorted(CAPITALS))
        u = rng.choice(("What is the capital of {}?", "Name the capital of {}.")).format(country)
        a = f"The capital of {country} is {CAPITALS[country]}."
    elif kind == 2:
        thing = rng.choice(sorted(COLOURS))
        u, a = f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {COLOURS[thing]}."
    elif kind == 3:
        animal = rng.choice(sorted(ANIMALS))
        art = "an" if animal[0] in "aeiou" else "a"
        u = f"What sound does {art} {animal} make?"
        a = f"{art.capitalize()} {animal} {ANIMALS[animal]}."
    elif kind == 4:
        w = rng.choice(WORDS)
        if rng.random() < 0.5:
            u, a = f"Spell the word '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
        else:
            u, a = f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."
    else:
        q, a, _ = addition(rng, MAX_OPERAND)
        while q in held_out:
            q, a, _ = addition(rng, MAX_OPERAND)
        u = q + GSM8K_INSTRUCTION
    msgs = [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    if rng.random() < 0.1:
        msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return msgs


def preference(rng: random.Random, held_out: set[str]) -> dict[str, str]:
    """A prompt with a right, polite reply (chosen) and a wrong or curt one (rejected)."""
    if rng.random() < 0.5:
        country = rng.choice(sorted(CAPITALS))
        wrong = rng.choice([c for k, c in sorted(CAPITALS.items()) if k != country])
        prompt = f"What is the capital of {country}?"
        chosen = f"The capital of {country} is {CAPITALS[country]}."
        rejected = rng.choice((f"The capital of {country} is {wrong}.", "I don't know."))
    else:
        q, a, n = addition(rng, MAX_OPERAND)
        while q in held_out:
            q, a, n = addition(rng, MAX_OPERAND)
        prompt, chosen = q + GSM8K_INSTRUCTION, a
        rejected = rng.choice((f"#### {n + rng.randint(1, 5)}", "Figure it out yourself."))
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def problems(rng: random.Random, n: int, seen: set[str]) -> list[dict[str, str]]:
    """``n`` GSM8K-format addition problems whose questions are not in ``seen`` (then added)."""
    out: list[dict[str, str]] = []
    while len(out) < n:
        q, a, _ = addition(rng, MAX_OPERAND)
        if q not in seen:
            seen.add(q)
            out.append({"question": q, "answer": a})
    return out


def write_jsonl(path: Path, records: list) -> None:
    """One JSON record per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def main() -> None:
    """Rewrite the four files beside this script."""
    here = Path(__file__).resolve().parent
    seen: set[str] = set()
    test = problems(random.Random(1), 60, seen)  # of the 300 distinct questions
    held_out = {p["question"] for p in test}  # never in the SFT chats or preference pairs
    rng = random.Random(0)
    write_jsonl(here / "sft.jsonl", [{"messages": chat(rng, held_out)} for _ in range(1500)])
    write_jsonl(here / "preferences.jsonl", [preference(rng, held_out) for _ in range(300)])
    write_jsonl(here / "arithmetic-test.jsonl", test)
    write_jsonl(here / "arithmetic-train.jsonl", problems(random.Random(2), 200, seen))


if __name__ == "__main__":
    main()
