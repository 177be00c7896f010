"""Drives the playground page of a running server in headless Chromium: asks one prompt, waits
for the whole answer, saves a screenshot (the README's, docs/playground.png).

    .venv/bin/python scripts/playground_screenshot.py --url http://localhost:8000/ --out docs/playground.png

Use a prompt the server has not answered yet: a drafter with memory across requests (suffix)
would draft a repeated answer from its memory."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.browser: the one Chromium launcher and page driver

PROMPT = """Add a parameter `reverse: bool = False` to this function that sorts the other way, and reply with the whole function:

def top_scores(scores: dict[str, int], count: int) -> list[tuple[str, int]]:
    \"\"\"The `count` highest scores, highest first, as (name, score) pairs.\"\"\"
    ranked = sorted(scores.items(), key=lambda item: item[1], reverse=True)
    return ranked[:count]
"""


def main() -> None:
    from selenium.webdriver.common.by import By

    from tests.browser import ask_playground, chromium

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://localhost:8000/")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--plan", default="adaptive", help="the page's speculation choice (adaptive, chain-8, rsd-s-16, off, ...)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default="docs/playground.png")
    args = parser.parse_args()
    browser = chromium()
    try:
        ask_playground(browser, args.url, args.prompt, args.plan, args.max_tokens)
        browser.save_screenshot(args.out)
        print(f"{args.out}: {browser.find_element(By.ID, 'stat-rate').text} tok/s, "
              f"{browser.find_element(By.ID, 'stat-per-round').text} tokens per round, {browser.find_element(By.ID, 'plans').text}")
    finally:
        browser.quit()


if __name__ == "__main__":
    main()
