"""The README's picture of the server's page (profiles/server_page.png), taken in headless Chromium.

    python -m scripts.screenshot_page [--out profiles/server_page.png]

Starts `python -m app serve` on the loopback address, sends a few chat requests that share a
long system prompt (so shared prefix pages show in the pool), types a prompt into the page,
and takes the picture while the reply streams. Needs Debian's chromium and chromium-driver
(`make browser`) and selenium (requirements-test.txt).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app import ROOT
from app.measure.local_server import free_port, wait_ready
from app.models import DEFAULT_MODEL, resolve
from app.report import browser

SYSTEM = ("You are a patient teacher who explains how computers work to curious children, in short sentences, "
          "with one everyday example each time, and who never uses jargon without saying what it means.")
QUESTIONS = ["What is memory?", "Why is a computer fast?", "What does a processor do?", "What is a cache?",
             "How does a keyboard talk to a computer?"]


def background(url: str, stop: threading.Event):
    """Clients that keep the engine busy, sharing the system prompt's pages."""
    import openai
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = c.models.list().data[0].id

    def client(i):
        while not stop.is_set():
            for _ in c.chat.completions.create(model=model,
                                               messages=[{"role": "system", "content": SYSTEM},
                                                         {"role": "user", "content": QUESTIONS[i]}],
                                               max_tokens=96, temperature=0.7, stream=True):
                if stop.is_set():
                    break
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
        time.sleep(0.7)                            # the first prefills the shared pages, the others find them


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=str(DEFAULT_MODEL.path), help="GGUF file or model name")
    p.add_argument("--stage", default="fastest", help="the server's stage (default: the one `serve` picks)")
    p.add_argument("--out", type=Path, default=ROOT / "profiles" / "server_page.png")
    args = p.parse_args(argv)
    why = browser.missing()
    if why:
        raise SystemExit(f"error: {why} (`make browser` installs chromium)")
    from selenium.webdriver.common.by import By

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="page-"))
    log = work / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "-m", str(resolve(args.model)), "--stage",
                                 args.stage, "--port", str(port), "--kv-pages", "128", "--max-batch", "8"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    stop = threading.Event()
    driver = None
    try:
        wait_ready(url, proc, log)
        driver = browser.chromium(work / "profile", "1400,900", ["--hide-scrollbars"])
        driver.get(url + "/")
        background(url, stop)
        time.sleep(3)
        driver.find_element(By.ID, "prompt").send_keys("Tell me about the sea, in three sentences.")
        driver.find_element(By.ID, "send").click()
        deadline = time.time() + 120
        while time.time() < deadline:
            text = driver.execute_script("const r = document.querySelector('#messages .msg.assistant:last-child');"
                                         "return r ? r.textContent : ''")
            if len(text) > 80:
                break
            time.sleep(0.1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        print(f"wrote {args.out}", file=sys.stderr)
    finally:
        stop.set()
        if driver is not None:
            driver.quit()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
