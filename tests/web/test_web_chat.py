"""The chat page served at `/`, end to end in headless Chromium against live runlm servers.

The real SmolLM2 answers where the model matters (streaming, the prompt cache, Stop freeing the slot);
a scripted runner answers where the test needs a known reply (HTML in the answer, regenerate and edit,
a slow answer to stop from the keyboard). Token counts stay small: every SmolLM2 token costs real CPU time.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import pytest
from web_harness import REPO, last_user_text, scripted_server, wait_until


def answer_done(page, count: int) -> None:
    """Wait for the count-th answer to finish (its figures shown, the Stop button gone)."""
    wait_until(
        page, "n => document.querySelectorAll('article.msg.assistant').length >= n && "
        "!document.querySelector('article.msg.assistant[aria-busy=true]') && "
        "document.getElementById('stop').hidden", arg=count)


def answers(page) -> list[str]:
    return page.eval_on_selector_all("article.msg.assistant .body", "els => els.map(e => e.innerText)")


def stat(page, name: str, index: int = -1) -> str | None:
    texts = page.eval_on_selector_all("article.msg.assistant", f"""els => els.map(e => {{
        const s = e.querySelector('.stat[data-stat="{name}"]'); return s ? s.textContent : null; }})""")
    return texts[index] if texts else None


def set_settings(page, **values: str) -> None:
    page.click("#settings-toggle")
    for field, value in values.items():
        page.fill(f"#set-{field.replace('_', '-')}", value)
    page.click("#settings-toggle")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def chat_bodies(page) -> list[dict]:
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return bodies


# -- the real model ----------------------------------------------------------------------------------------------


def test_streamed_exchange_with_figures_cache_hit_and_reload(real_server, open_page):
    page = open_page(real_server.base_url)
    assert page.inner_text("#model-name") == "smollm2-135m"
    meta = page.inner_text("#model-meta")
    assert "8k context" in meta and "Q4_1" in meta, meta
    assert page.is_hidden("#attach")  # SmolLM2 reads no images
    bodies = chat_bodies(page)
    set_settings(page, system="Answer in one short sentence.", temperature="0", top_p="0.9", max_tokens="12",
                 seed="7")
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const b = document.querySelector('article.msg.assistant:last-of-type .body');
            if (b) window.__lengths.push(b.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    send(page, "What is the capital of France?")
    answer_done(page, 1)
    lengths = page.evaluate("window.__lengths")
    grown = sorted({n for n in lengths if n > 0})
    assert len(grown) >= 3, lengths  # the answer appeared piece by piece, not at once
    (body,) = bodies
    assert body["model"] == "smollm2-135m" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0, 0.9, 12, 7)
    assert body["messages"][0] == {"role": "system", "content": "Answer in one short sentence."}
    assert body["messages"][1] == {"role": "user", "content": "What is the capital of France?"}
    first = answers(page)[0]
    assert first.strip()
    tokens = int(re.fullmatch(r"(\d+) tokens?", stat(page, "tokens")).group(1))
    assert 0 < tokens <= 12
    assert re.fullmatch(r"TTFT \d+(\.\d+)? m?s", stat(page, "ttft"))
    assert stat(page, "tps").endswith("tok/s")
    assert stat(page, "cache") is not None

    send(page, "And of Italy?")
    answer_done(page, 2)
    assert stat(page, "cache").startswith("cache hit"), stat(page, "cache")  # the first turn's prefix was reused
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert bodies[1]["messages"][2]["content"] == first.strip() or bodies[1]["messages"][2]["content"].strip()
    (REPO / "artifacts").mkdir(exist_ok=True)
    page.screenshot(path=str(REPO / "artifacts" / "web-chat.png"))

    page.reload()
    wait_until(page, "!!document.querySelector('#model-meta').textContent")
    titles = page.eval_on_selector_all(".conv-open", "els => els.map(e => e.textContent)")
    assert titles == ["What is the capital of France?"]
    assert page.get_attribute(".conv-open", "aria-current") == "true"
    assert page.eval_on_selector_all(".user-text", "els => els.map(e => e.textContent)") == [
        "What is the capital of France?", "And of Italy?"]
    assert answers(page)[0] == first and stat(page, "cache").startswith("cache hit")


def test_stop_aborts_and_the_server_takes_the_next_request_at_once(real_server, open_page):
    page = open_page(real_server.base_url)
    set_settings(page, temperature="0", max_tokens="300")
    send(page, "Count from 1 to 100, separated by commas.")
    wait_until(page, "() => { const b = document.querySelector('article.msg.assistant .body');"
               " return b && b.innerText.length >= 6; }")
    page.click("#stop")
    stopped_at = time.monotonic()
    answer_done(page, 1)
    assert stat(page, "finish") == "stopped"
    partial = answers(page)[0]
    assert partial.strip()
    with httpx.Client(base_url=real_server.base_url, timeout=10) as c:
        while c.get("/health").json()["busy"]:
            assert time.monotonic() - stopped_at < 2.0, "the generation kept its slot after Stop"
            time.sleep(0.05)
        assert 'runlm_generations_total{finish_reason="cancelled"}' in c.get("/metrics").text
    assert page.is_visible("#send") and page.is_hidden("#stop")
    set_settings(page, max_tokens="3")
    started = time.monotonic()
    send(page, "Say hi.")
    answer_done(page, 2)
    assert time.monotonic() - started < 15
    ttft = stat(page, "ttft")
    value, unit = re.fullmatch(r"TTFT (\d+(?:\.\d+)?) (m?s)", ttft).groups()
    assert float(value) / (1000 if unit == "ms" else 1) < 5.0, ttft  # not queued behind the stopped one
    assert answers(page)[0] == partial  # the stopped answer stays as it was


# -- scripted answers ----------------------------------------------------------------------------------------------

XSS = ('Here is <b>bold?</b> <script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2"> '
       '[click](javascript:window.__pwned=3) <a href="javascript:window.__pwned=4">a</a>\n\n'
       '```python\ndef add(a, b):\n    return a + b  # the sum\n```\n\nDone: **bold** and `code`.')


@pytest.fixture(scope="module")
def xss_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: XSS)
    yield server
    server.stop()


def test_html_in_model_output_renders_as_text(xss_server, open_page):
    page = open_page(xss_server.base_url, permissions=["clipboard-read", "clipboard-write"])
    send(page, "Show me some HTML.")
    answer_done(page, 1)
    body = "article.msg.assistant .body"
    assert page.evaluate("window.__pwned") is None
    assert page.eval_on_selector(body, "b => b.querySelectorAll('script, img, iframe, b, object, svg').length") == 0
    assert page.eval_on_selector(body, "b => [...b.querySelectorAll('a')].map(a => a.href)") == []
    text = page.inner_text(body)
    assert "<script>window.__pwned = 1</script>" in text
    assert '<img src=x onerror="window.__pwned = 2">' in text and "<b>bold?</b>" in text
    assert page.inner_text(f"{body} strong") == "bold" and page.inner_text(f"{body} p code") == "code"
    code = page.inner_text(f"{body} .code-block pre code")
    assert code == "def add(a, b):\n    return a + b  # the sum"
    keywords = page.eval_on_selector_all(f"{body} .code-block .tok-keyword", "els => els.map(e => e.textContent)")
    assert keywords == ["def", "return"]
    assert page.inner_text(f"{body} .code-block .tok-comment") == "# the sum"
    page.click(f"{body} .copy-code")
    assert page.inner_text(f"{body} .copy-code") == "Copied"
    assert page.evaluate("navigator.clipboard.readText()") == code

    # Stored conversations are model output too: tamper with one and reload.
    page.evaluate("""() => {
        const s = JSON.parse(localStorage.getItem('runlm.chat.v1'));
        s.conversations[0].messages.push({role: 'user', content: '<img src=x onerror="window.__pwned=5">'},
            {role: 'assistant', content: '<svg onload="window.__pwned=6"></svg> <iframe src="javascript:1"></iframe>'});
        localStorage.setItem('runlm.chat.v1', JSON.stringify(s));
    }""")
    page.reload()
    wait_until(page, "document.querySelectorAll('article.msg').length === 4")
    page.wait_for_timeout(200)
    assert page.evaluate("window.__pwned") is None
    assert page.eval_on_selector("#messages", "m => m.querySelectorAll('script, img, iframe, svg').length") == 0
    assert "<svg onload=" in answers(page)[1]


@pytest.fixture(scope="module")
def echo_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: f"Reply {n} to: {last_user_text(prompt)}")
    yield server
    server.stop()


def test_regenerate_and_edit_the_last_turn(echo_server, open_page):
    page = open_page(echo_server.base_url)
    n0 = echo_server.runner.calls
    send(page, "alpha")
    answer_done(page, 1)
    assert answers(page) == [f"Reply {n0 + 1} to: alpha"]
    page.click("button[aria-label='Regenerate the last answer']")
    wait_until(page, "n => document.querySelector('article.msg.assistant .body').innerText"
               ".startsWith('Reply ' + n)", arg=n0 + 2)
    answer_done(page, 1)
    assert answers(page) == [f"Reply {n0 + 2} to: alpha"]
    page.click("button[aria-label='Edit and resend your last message']")
    editor = page.locator("textarea[aria-label='Edit your message']")
    assert editor.input_value() == "alpha"
    editor.fill("beta")
    editor.press("Enter")
    wait_until(page, "n => document.querySelector('article.msg.assistant .body').innerText"
               ".startsWith('Reply ' + n)", arg=n0 + 3)
    answer_done(page, 1)
    assert page.eval_on_selector_all(".user-text", "els => els.map(e => e.textContent)") == ["beta"]
    assert answers(page) == [f"Reply {n0 + 3} to: beta"]
    # Esc leaves the editor without changing anything
    page.click("button[aria-label='Edit and resend your last message']")
    page.locator("textarea[aria-label='Edit your message']").press("Escape")
    assert page.eval_on_selector_all(".user-text", "els => els.map(e => e.textContent)") == ["beta"]
    assert echo_server.runner.calls == n0 + 3


def test_sidebar_switches_renames_and_deletes_conversations(echo_server, open_page):
    page = open_page(echo_server.base_url)
    page.on("dialog", lambda d: d.accept())
    send(page, "first topic")
    answer_done(page, 1)
    set_settings(page, temperature="0.2")
    page.click("#new-chat")
    assert page.is_visible(".empty") and page.input_value("#set-temperature") == "0.2"  # new chats inherit
    set_settings(page, temperature="1.1")
    send(page, "second topic")
    answer_done(page, 1)
    assert page.eval_on_selector_all(".conv-open", "els => els.map(e => e.textContent)") == [
        "second topic", "first topic"]
    page.click(".conv-open >> text=first topic")
    assert page.eval_on_selector_all(".user-text", "els => els.map(e => e.textContent)") == ["first topic"]
    assert page.input_value("#set-temperature") == "0.2"  # settings belong to the conversation
    page.click("button[aria-label='Rename conversation: first topic']")
    page.fill(".conv-title-input", "Renamed")
    page.press(".conv-title-input", "Enter")
    assert page.eval_on_selector_all(".conv-open", "els => els.map(e => e.textContent)") == [
        "second topic", "Renamed"]
    page.click("button[aria-label='Delete conversation: second topic']")
    assert page.eval_on_selector_all(".conv-open", "els => els.map(e => e.textContent)") == ["Renamed"]
    page.reload()
    page.wait_for_selector(".user-text")
    assert page.eval_on_selector_all(".conv-open", "els => els.map(e => e.textContent)") == ["Renamed"]
    assert page.eval_on_selector_all(".user-text", "els => els.map(e => e.textContent)") == ["first topic"]
    assert page.input_value("#set-temperature") == "0.2"


@pytest.fixture(scope="module")
def slow_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: "word " * 300, delay_s=0.02)
    yield server
    server.stop()


def test_keyboard_alone_enter_shift_enter_escape_and_labelled_controls(slow_server, open_page):
    page = open_page(slow_server.base_url)
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    page.keyboard.press("Enter")
    page.wait_for_selector(".user-text")
    assert page.inner_text(".user-text") == "first line\nsecond line" and page.input_value("#prompt") == ""
    wait_until(page, "() => { const b = document.querySelector('article.msg.assistant .body');"
               " return b && b.innerText.length > 20; }")
    page.keyboard.press("Escape")
    answer_done(page, 1)
    assert stat(page, "finish") == "stopped"
    assert len(answers(page)[0]) < len("word " * 300) - 20
    with httpx.Client(base_url=slow_server.base_url, timeout=10) as c:
        deadline = time.monotonic() + 2
        while c.get("/health").json()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "send"
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('button, input, textarea, select')]
        .filter(e => !(e.getAttribute('aria-label') || (e.labels && e.labels.length) || e.textContent.trim()))
        .map(e => e.outerHTML.slice(0, 80))""")
    assert unlabelled == []


# -- API key ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def key_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: "Welcome back.", name="keyed", api_key="s3cret")
    yield server
    server.stop()


def test_api_key_is_asked_once_kept_for_the_tab_and_never_in_a_url(key_server, open_page):
    requests: list = []
    page = open_page(key_server.base_url, wait_model=False, allow_console=("401",))
    page.on("request", lambda r: requests.append(r))
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    page.wait_for_selector("#key-error:not([hidden])")
    assert "did not accept" in page.inner_text("#key-error")
    assert page.is_visible("#key-dialog")
    page.fill("#api-key", "s3cret")
    page.press("#api-key", "Enter")
    wait_until(page, "document.getElementById('model-name').textContent === 'keyed'")
    assert not page.is_visible("#key-dialog")
    send(page, "hello")
    answer_done(page, 1)
    assert answers(page) == ["Welcome back."]
    assert page.evaluate("sessionStorage.getItem('runlm.apiKey')") == "s3cret"
    assert "s3cret" not in page.evaluate("JSON.stringify(localStorage)")
    assert all("s3cret" not in r.url for r in requests)
    chat = [r for r in requests if r.url.endswith("/v1/chat/completions")]
    assert chat and chat[-1].headers.get("authorization") == "Bearer s3cret"
    page.reload()
    wait_until(page, "document.getElementById('model-name').textContent === 'keyed'")
    assert not page.is_visible("#key-dialog") and answers(page) == ["Welcome back."]


# -- phone width -----------------------------------------------------------------------------------------------------

LONG = {
    "version": 1, "currentId": "c1", "conversations": [{
        "id": "c1", "title": "A long one " + "x" * 120, "created": 1, "updated": 2, "settings": {},
        "messages": [
            {"role": "user", "content": "unbroken" * 30},
            {"role": "assistant", "content": "A very long word: " + "y" * 200 + "\n\nhttps://example.com/" + "p" * 150
             + "\n\n```python\nx = '" + "z" * 300 + "'\n```\n\n| " + " | ".join(f"column {i}" for i in range(12))
             + " |\n|" + "---|" * 12 + "\n| " + " | ".join(str(i) for i in range(12)) + " |\n\n- a list item "
             + "w" * 100, "stats": {"tokens": 99, "exact": True, "ttftMs": 12, "tps": 40.0, "promptTokens": 10,
                                    "cachedTokens": 0}},
        ]}]}
OVERFLOW_JS = """() => {
    const vw = document.documentElement.clientWidth, bad = [];
    for (const el of document.querySelectorAll('#main *')) {
        if (el.parentElement.closest('pre, .table-wrap')) continue;  // these scroll inside their own box
        const r = el.getBoundingClientRect();
        if (!r.width && !r.height) continue;
        if (r.right > vw + 1 || r.left < -1) bad.push(el.tagName + '.' + el.className + ' ' + r.left + '..' + r.right);
    }
    const m = document.getElementById('messages');
    return {page: document.documentElement.scrollWidth - vw, messages: m.scrollWidth - m.clientWidth, bad};
}"""


def test_phone_width_has_no_horizontal_scroll(echo_server, open_page):
    page = open_page(echo_server.base_url, viewport={"width": 375, "height": 740}, has_touch=True)
    page.evaluate("s => localStorage.setItem('runlm.chat.v1', JSON.stringify(s))", LONG)
    page.reload()
    page.wait_for_selector("article.msg.assistant .code-block")
    assert page.evaluate(OVERFLOW_JS) == {"page": 0, "messages": 0, "bad": []}
    assert not page.is_visible("#sidebar") and page.is_visible("#open-sidebar")
    page.click("#open-sidebar")
    wait_until(page, "getComputedStyle(document.getElementById('sidebar')).visibility === 'visible'")
    assert page.evaluate("document.getElementById('sidebar').getBoundingClientRect().right") <= 375
    page.click(".conv-open")
    wait_until(page, "getComputedStyle(document.getElementById('sidebar')).visibility === 'hidden'")
    send(page, "short question " + "q" * 90)
    answer_done(page, 2)
    page.click("#settings-toggle")
    assert page.evaluate(OVERFLOW_JS) == {"page": 0, "messages": 0, "bad": []}
    page.click("#settings-toggle")
    (REPO / "artifacts").mkdir(exist_ok=True)
    page.screenshot(path=str(REPO / "artifacts" / "web-chat-phone.png"))


# -- images ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: "unused", name="seeing", multimodal=True)
    yield server
    server.stop()


def _png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 12), color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_attach_by_picker_and_drop_when_the_model_reads_images(vision_server, open_page):
    page = open_page(vision_server.base_url)
    sent: list[dict] = []

    def fake_completion(route):  # the page's side of images; the server's is tested with the vision model
        sent.append(json.loads(route.request.post_data))
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"index": 0, "delta": {"content": "A red "}}]},
                  {"choices": [{"index": 0, "delta": {"content": "square."}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 3, "total_tokens": 303,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fake_completion)
    assert page.is_visible("#attach")
    red = _png((220, 20, 20))
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files([{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    page.wait_for_selector(".attachment img")
    send(page, "What is this?")
    answer_done(page, 1)
    assert answers(page) == ["A red square."]
    assert page.is_hidden("#attachments")
    (body,) = sent
    image_part, text_part = body["messages"][-1]["content"]
    assert text_part == {"type": "text", "text": "What is this?"}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == red
    assert page.get_attribute("article.msg.user img", "src") == url

    blue = _png((20, 20, 220))
    page.evaluate("""b64 => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], 'blue.png', {type: 'image/png'}));
        window.dispatchEvent(new DragEvent('dragenter', {dataTransfer: dt, bubbles: true}));
        window.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
    }""", base64.b64encode(blue).decode())
    page.wait_for_selector(".attachment img")
    send(page, "And this?")
    answer_done(page, 2)
    msgs = sent[1]["messages"]
    assert msgs[0]["content"] == "[an image was shared here]\nWhat is this?"  # one image per request: the latest
    assert base64.b64decode(msgs[-1]["content"][0]["image_url"]["url"].split(",", 1)[1]) == blue


# -- the Markdown renderer on its own ----------------------------------------------------------------------------

RENDER_JS = ("t => { const d = document.createElement('div'); d.appendChild(RunlmMarkdown.render(t));"
             " return d.innerHTML; }")
A = ' target="_blank" rel="noopener noreferrer nofollow"'
MARKDOWN = [
    ("a *b* **c** ***d*** _e_ snake_case 2 * 3 ~~f~~",
     "<p>a <em>b</em> <strong>c</strong> <em><strong>d</strong></em> <em>e</em> snake_case 2 * 3 <del>f</del></p>"),
    ("1. one\n2. two\n   - x\n   - y", "<ol><li><p>one</p></li><li><p>two</p><ul><li><p>x</p></li><li><p>y</p></li>"
                                       "</ul></li></ol>"),
    ("> quote\n\n# Title #\nline1\nline2\n\n---", "<blockquote><p>quote</p></blockquote><h1>Title</h1>"
                                                 "<p>line1<br>line2</p><hr>"),
    ("| a | b |\n|:-|-:|\n| `x|y` | 2 |", '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th>'
     '<th class="align-right">b</th></tr></thead><tbody><tr><td class="align-left"><code>x|y</code></td>'
     '<td class="align-right">2</td></tr></tbody></table></div>'),
    ("see https://e.com/a_(b). [t](javascript:alert(1)) ![i](https://e.com/i.png)",
     f'<p>see <a href="https://e.com/a_(b)"{A}>https://e.com/a_(b)</a>. t <a href="https://e.com/i.png"{A}>i</a></p>'),
    ("&lt;script&gt; &#60;b&#62; <i onmouseover=x>", "<p>&lt;script&gt; &lt;b&gt; &lt;i onmouseover=x&gt;</p>"),
    ("```sh\necho $HOME  # hi\n", '<div class="code-block"><div class="code-head"><span class="code-lang">sh</span>'
     '<button class="copy-code" type="button" aria-label="Copy code (sh)">Copy</button></div><pre>'
     '<code class="language-sh"><span class="tok-builtin">echo</span> <span class="tok-variable">$HOME</span>  '
     '<span class="tok-comment"># hi</span></code></pre></div>'),
]


def test_markdown_renderer_builds_safe_dom(echo_server, open_page):
    page = open_page(echo_server.base_url)
    for source, html in MARKDOWN:
        assert page.evaluate(RENDER_JS, source) == html, source
