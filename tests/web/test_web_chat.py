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
from web_harness import REPO, exactly, expect, last_user_text, scripted_server, server_until

ANSWER = "article.msg.assistant .body"
CHAT = "**/v1/chat/completions"


def answer_done(page, count: int) -> None:
    """Wait for the count-th answer to finish (its figures shown, the Stop button gone).

    Sending, regenerating and resending mark the new answer busy (and show Stop) before the key or click returns,
    so these hold only once it has ended; the answer is final from then on."""
    expect(page.locator("article.msg.assistant")).to_have_count(count)
    expect(page.locator("article.msg.assistant[aria-busy=true]")).to_have_count(0)
    expect(page.locator("#stop")).to_be_hidden()


def answers(page) -> list[str]:
    """The answers' texts as they are now: read them only once answer_done has returned."""
    return page.eval_on_selector_all(ANSWER, "els => els.map(e => e.innerText)")


def expect_answers(page, *texts: str) -> None:
    """Wait until the answers read exactly `texts` (as innerText, so paragraphs and line breaks count)."""
    expect(page.locator(ANSWER)).to_have_text([exactly(t) for t in texts], use_inner_text=True)


def stat(page, name: str):
    """The last answer's figure `name` (a locator: expect it to show what it should)."""
    return page.locator("article.msg.assistant").last.locator(f'.stat[data-stat="{name}"]')


def set_settings(page, **values: str) -> None:
    page.click("#settings-toggle")
    for field, value in values.items():
        page.fill(f"#set-{field.replace('_', '-')}", value)
    page.click("#settings-toggle")
    expect(page.locator("#settings")).to_be_hidden()


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def chat_bodies(page) -> list[dict]:
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return bodies


def pace_event_streams(page) -> None:
    """Hand the page each server-sent event of a stream two animation frames after the one before.

    The page paints a streamed answer once per animation frame, and a 12-token answer from this model can arrive
    within one frame; paced by frames (not by a time), every event gets a paint of its own, so "the answer grew
    piece by piece" is checked on every machine, fast or slow."""
    page.evaluate("""() => {
        const realFetch = window.fetch;
        const twoFrames = () => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
        window.fetch = async (...args) => {
            const res = await realFetch(...args);
            if (!(res.headers.get('content-type') || '').includes('text/event-stream')) return res;
            const reader = res.body.getReader(), decoder = new TextDecoder(), encoder = new TextEncoder();
            let buffer = '';
            const events = [];
            const body = new ReadableStream({ async pull(controller) {
                while (!events.length) {
                    const chunk = await reader.read();
                    if (chunk.done) {
                        if (buffer) controller.enqueue(encoder.encode(buffer));
                        buffer = '';
                        controller.close();
                        return;
                    }
                    buffer += decoder.decode(chunk.value, { stream: true });
                    const parts = buffer.split('\\n\\n');
                    buffer = parts.pop();
                    for (const part of parts) events.push(part + '\\n\\n');
                }
                await twoFrames();
                controller.enqueue(encoder.encode(events.shift()));
            }, cancel(reason) { return reader.cancel(reason); } });
            return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
        };
    }""")


# -- the real model ----------------------------------------------------------------------------------------------


def test_streamed_exchange_with_figures_cache_hit_and_reload(real_server, open_page):
    page = open_page(real_server.base_url)
    expect(page.locator("#model-name")).to_have_text("smollm2-135m")
    expect(page.locator("#model-meta")).to_contain_text("8k context")
    expect(page.locator("#model-meta")).to_contain_text("Q4_1")
    expect(page.locator("#attach")).to_be_hidden()  # SmolLM2 reads no images
    bodies = chat_bodies(page)
    set_settings(page, system="Answer in one short sentence.", temperature="0", top_p="0.9", max_tokens="12",
                 seed="7")
    pace_event_streams(page)
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const b = document.querySelector('article.msg.assistant:last-of-type .body');
            if (b) window.__lengths.push(b.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    with page.expect_request(CHAT) as first_request:
        send(page, "What is the capital of France?")
    answer_done(page, 1)
    lengths = page.evaluate("window.__lengths")
    grown = sorted({n for n in lengths if n > 0})
    assert len(grown) >= 3, lengths  # the answer appeared piece by piece, not at once
    (body,) = bodies
    assert body == first_request.value.post_data_json
    assert body["model"] == "smollm2-135m" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0, 0.9, 12, 7)
    assert body["messages"][0] == {"role": "system", "content": "Answer in one short sentence."}
    assert body["messages"][1] == {"role": "user", "content": "What is the capital of France?"}
    first = answers(page)[0]
    assert first.strip()
    expect(stat(page, "tokens")).to_have_text(re.compile(r"^\d+ tokens?$"))
    tokens = int(stat(page, "tokens").text_content().split()[0])
    assert 0 < tokens <= 12
    expect(stat(page, "ttft")).to_have_text(re.compile(r"^TTFT \d+(\.\d+)? m?s$"))
    expect(stat(page, "tps")).to_have_text(re.compile(r"tok/s$"))
    expect(stat(page, "cache")).to_have_count(1)

    with page.expect_request(CHAT):
        send(page, "And of Italy?")
    answer_done(page, 2)
    expect(stat(page, "cache")).to_have_text(re.compile(r"^cache hit"))  # the first turn's prefix was reused
    assert len(bodies) == 2
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert bodies[1]["messages"][2]["content"] == first.strip() or bodies[1]["messages"][2]["content"].strip()
    (REPO / "artifacts").mkdir(exist_ok=True)
    page.screenshot(path=str(REPO / "artifacts" / "web-chat.png"))

    page.reload()
    expect(page.locator("#model-meta")).not_to_be_empty()
    expect(page.locator(".conv-open")).to_have_text([exactly("What is the capital of France?")])
    expect(page.locator(".conv-open")).to_have_attribute("aria-current", "true")
    expect(page.locator(".user-text")).to_have_text([exactly("What is the capital of France?"),
                                                     exactly("And of Italy?")])
    expect(page.locator(ANSWER).first).to_have_text(exactly(first), use_inner_text=True)
    expect(stat(page, "cache")).to_have_text(re.compile(r"^cache hit"))


def test_stop_aborts_and_the_server_takes_the_next_request_at_once(real_server, open_page):
    page = open_page(real_server.base_url)
    set_settings(page, temperature="0", max_tokens="300")
    send(page, "Count from 1 to 100, separated by commas.")
    expect(page.locator(ANSWER)).to_have_text(re.compile(r"[\s\S]{6}"), use_inner_text=True)
    page.click("#stop")
    stopped_at = time.monotonic()
    answer_done(page, 1)
    expect(stat(page, "finish")).to_have_text("stopped")
    partial = answers(page)[0]
    assert partial.strip()
    with httpx.Client(base_url=real_server.base_url, timeout=10) as c:
        server_until(lambda: not c.get("/health").json()["busy"], "the generation kept its slot after Stop",
                     deadline=stopped_at + 2.0)
        # The worker frees the slot first, then counts the generation: wait for the count, too.
        server_until(lambda: 'runlm_generations_total{finish_reason="cancelled"}' in c.get("/metrics").text,
                     "the stopped generation was not counted as cancelled")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    set_settings(page, max_tokens="3")
    started = time.monotonic()
    send(page, "Say hi.")
    answer_done(page, 2)
    assert time.monotonic() - started < 15
    expect(stat(page, "ttft")).to_have_text(re.compile(r"^TTFT \d+(\.\d+)? m?s$"))
    ttft = stat(page, "ttft").text_content()
    value, unit = re.fullmatch(r"TTFT (\d+(?:\.\d+)?) (m?s)", ttft).groups()
    assert float(value) / (1000 if unit == "ms" else 1) < 5.0, ttft  # not queued behind the stopped one
    expect(page.locator(ANSWER).first).to_have_text(exactly(partial), use_inner_text=True)  # stays as it was


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
    body = page.locator(ANSWER)
    # The answer has rendered, as text, before anything is said about what did not run.
    for shown in ("<script>window.__pwned = 1</script>", '<img src=x onerror="window.__pwned = 2">', "<b>bold?</b>"):
        expect(body).to_contain_text(re.compile(re.escape(shown)), use_inner_text=True)
    expect(body.locator("strong")).to_have_text(exactly("bold"))
    expect(body.locator("p code")).to_have_text(exactly("code"))
    code = "def add(a, b):\n    return a + b  # the sum"
    expect(body.locator(".code-block pre code")).to_have_text(exactly(code), use_inner_text=True)
    expect(body.locator(".code-block .tok-keyword")).to_have_text([exactly("def"), exactly("return")])
    expect(body.locator(".code-block .tok-comment")).to_have_text(exactly("# the sum"))
    assert page.evaluate("window.__pwned") is None
    assert body.evaluate("b => b.querySelectorAll('script, img, iframe, b, object, svg').length") == 0
    assert body.evaluate("b => [...b.querySelectorAll('a')].map(a => a.href)") == []
    # The button says "Copied" once the clipboard holds the code, and goes back to "Copy" 1.5 s later: record
    # what it says rather than hope to look within that window.
    copy = body.locator(".copy-code")
    copy.evaluate("""b => {
        window.__copyLabels = [];
        new MutationObserver(() => window.__copyLabels.push(b.textContent))
            .observe(b, {childList: true, characterData: true, subtree: true});
    }""")
    copy.click()
    page.wait_for_function("() => window.__copyLabels.length > 0")
    assert page.evaluate("window.__copyLabels[0]") == "Copied"
    assert page.evaluate("navigator.clipboard.readText()") == code

    # Stored conversations are model output too: tamper with one and reload.
    page.evaluate("""() => {
        const s = JSON.parse(localStorage.getItem('runlm.chat.v1'));
        s.conversations[0].messages.push({role: 'user', content: '<img src=x onerror="window.__pwned=5">'},
            {role: 'assistant', content: '<svg onload="window.__pwned=6"></svg> <iframe src="javascript:1"></iframe>'});
        localStorage.setItem('runlm.chat.v1', JSON.stringify(s));
    }""")
    page.reload()
    expect(page.locator("article.msg")).to_have_count(4)
    expect(page.locator(".user-text").last).to_have_text(exactly('<img src=x onerror="window.__pwned=5">'))
    expect(page.locator(ANSWER).last).to_contain_text(re.compile(re.escape("<svg onload=")), use_inner_text=True)
    assert page.evaluate("window.__pwned") is None
    assert page.eval_on_selector("#messages", "m => m.querySelectorAll('script, img, iframe, svg').length") == 0


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{# the model answers in <think> tags #}")


def test_the_thinking_folds_away_above_the_answer(smollm2_loaded, open_page):
    """A reply's <think> phase shows as text in a closed "Thoughts" fold, the answer as Markdown below it."""
    from runlm.text.chat import ChatTemplate

    thought = "Weigh <b>both</b> sides."
    server = scripted_server(smollm2_loaded, lambda prompt, n: f"<think>\n{thought}\n</think>\n\nThe **answer**.",
                             chat_template=ChatTemplate(THINKING_TEMPLATE))
    try:
        page = open_page(server.base_url)
        send(page, "Think first.")
        answer_done(page, 1)
        body = page.locator(ANSWER)
        fold = body.locator("details.thinking")
        expect(fold.locator("summary")).to_have_text(exactly("Thoughts"))
        expect(fold).not_to_have_attribute("open", "")
        expect(fold.locator(".thinking-text")).to_have_text(exactly(thought), use_inner_text=False)
        expect(body.locator("strong")).to_have_text(exactly("answer"))
        assert body.evaluate("b => b.querySelectorAll('b').length") == 0
        fold.locator("summary").click()
        expect(fold.locator(".thinking-text")).to_be_visible()
    finally:
        server.stop()


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n")
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tool_calls_show_as_cards_and_the_results_you_give_go_back(smollm2_loaded, open_page):
    """With tools in the settings, a call streams into a card (its name, its arguments as indented JSON); the
    result typed under it goes back as the call's tool message, and the model answers from it."""
    from runlm.text.chat import ChatTemplate

    def reply(prompt: str, n: int) -> str:
        if "<|im_start|>tool" in prompt:
            return "It is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0] + " in Paris."
        return 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

    server = scripted_server(smollm2_loaded, reply, chat_template=ChatTemplate(HERMES_TEMPLATE))
    try:
        page = open_page(server.base_url)
        bodies = chat_bodies(page)
        set_settings(page, tools="not json")
        page.click("#settings-toggle")
        expect(page.locator("#tools-error")).to_contain_text("Tools: not JSON")
        page.fill("#set-tools", json.dumps([WEATHER_TOOL]))
        expect(page.locator("#tools-error")).to_be_hidden()
        page.click("#settings-toggle")
        send(page, "Weather in Paris?")
        answer_done(page, 1)
        card = page.locator(f"{ANSWER} section.tool-call")
        expect(card).to_have_count(1)
        expect(card.locator(".tool-name")).to_have_text(exactly("get_weather()"))
        expect(card.locator(".tool-args")).to_have_text(exactly('{\n  "city": "Paris"\n}'), use_inner_text=False)
        expect(page.locator(ANSWER).locator("p")).to_have_text(exactly("Let me check."))
        assert bodies[0]["tools"] == [WEATHER_TOOL]

        page.fill('textarea[aria-label="Result of get_weather"]', "sunny")
        page.click("text=Send result")
        answer_done(page, 2)
        expect(page.locator("article.msg.tool .tool-result")).to_have_text(exactly("sunny"))
        expect(page.locator(ANSWER).last).to_have_text(exactly("It is sunny in Paris."))
        call_id = bodies[1]["messages"][1]["tool_calls"][0]["id"]
        assert call_id and bodies[1]["messages"][2] == {"role": "tool", "tool_call_id": call_id, "content": "sunny"}
        expect(page.locator(".tool-result-form")).to_have_count(0)

        page.reload()  # the calls and the result are kept with the conversation
        expect(page.locator(f"{ANSWER} section.tool-call .tool-name")).to_have_text(exactly("get_weather()"))
        expect(page.locator("article.msg.tool .tool-result")).to_have_text(exactly("sunny"))
    finally:
        server.stop()


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
    expect_answers(page, f"Reply {n0 + 1} to: alpha")
    page.click("button[aria-label='Regenerate the last answer']")
    expect(page.locator(ANSWER)).to_have_text(re.compile(f"^Reply {n0 + 2}"), use_inner_text=True)
    answer_done(page, 1)
    expect_answers(page, f"Reply {n0 + 2} to: alpha")
    page.click("button[aria-label='Edit and resend your last message']")
    editor = page.locator("textarea[aria-label='Edit your message']")
    expect(editor).to_have_value("alpha")
    editor.fill("beta")
    editor.press("Enter")
    expect(page.locator(ANSWER)).to_have_text(re.compile(f"^Reply {n0 + 3}"), use_inner_text=True)
    answer_done(page, 1)
    expect(page.locator(".user-text")).to_have_text([exactly("beta")])
    expect_answers(page, f"Reply {n0 + 3} to: beta")
    # Esc leaves the editor without changing anything: the turn shows again as it was, with nothing sent
    page.click("button[aria-label='Edit and resend your last message']")
    editor.press("Escape")
    expect(editor).to_have_count(0)
    expect(page.locator(".user-text")).to_have_text([exactly("beta")])
    answer_done(page, 1)
    expect_answers(page, f"Reply {n0 + 3} to: beta")
    assert echo_server.runner.calls == n0 + 3


def test_sidebar_switches_renames_and_deletes_conversations(echo_server, open_page):
    page = open_page(echo_server.base_url)
    page.on("dialog", lambda d: d.accept())
    send(page, "first topic")
    answer_done(page, 1)
    set_settings(page, temperature="0.2")
    page.click("#new-chat")
    expect(page.locator(".empty")).to_be_visible()
    expect(page.locator("#set-temperature")).to_have_value("0.2")  # new chats inherit
    set_settings(page, temperature="1.1")
    send(page, "second topic")
    answer_done(page, 1)
    titles = page.locator(".conv-open")
    expect(titles).to_have_text([exactly("second topic"), exactly("first topic")])
    page.click(".conv-open >> text=first topic")
    expect(page.locator(".user-text")).to_have_text([exactly("first topic")])
    expect(page.locator("#set-temperature")).to_have_value("0.2")  # settings belong to the conversation
    page.click("button[aria-label='Rename conversation: first topic']")
    page.fill(".conv-title-input", "Renamed")
    page.press(".conv-title-input", "Enter")
    expect(titles).to_have_text([exactly("second topic"), exactly("Renamed")])
    page.click("button[aria-label='Delete conversation: second topic']")
    expect(titles).to_have_text([exactly("Renamed")])
    page.reload()
    expect(titles).to_have_text([exactly("Renamed")])
    expect(page.locator(".user-text")).to_have_text([exactly("first topic")])
    expect(page.locator("#set-temperature")).to_have_value("0.2")


@pytest.fixture(scope="module")
def slow_server(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: "word " * 300, delay_s=0.02)
    yield server
    server.stop()


def test_keyboard_alone_enter_shift_enter_escape_and_labelled_controls(slow_server, open_page):
    page = open_page(slow_server.base_url)
    prompt = page.locator("#prompt")
    expect(prompt).to_be_focused()
    page.keyboard.type("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    expect(prompt).to_have_value("first line\nsecond line")
    page.keyboard.press("Enter")
    expect(page.locator(".user-text")).to_have_text(exactly("first line\nsecond line"), use_inner_text=True)
    expect(prompt).to_have_value("")
    expect(page.locator(ANSWER)).to_have_text(re.compile(r"[\s\S]{21}"), use_inner_text=True)
    page.keyboard.press("Escape")
    answer_done(page, 1)
    expect(stat(page, "finish")).to_have_text("stopped")
    assert len(answers(page)[0]) < len("word " * 300) - 20
    with httpx.Client(base_url=slow_server.base_url, timeout=10) as c:
        server_until(lambda: not c.get("/health").json()["busy"], "the generation kept its slot after Esc",
                     timeout=2.0)
    expect(prompt).to_be_focused()
    page.keyboard.press("Tab")
    expect(page.locator("#send")).to_be_focused()
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
    dialog = page.locator("#key-dialog")
    expect(page.locator("#key-dialog[open]")).to_be_visible()
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-error")).to_be_visible()
    expect(page.locator("#key-error")).to_contain_text("did not accept")
    expect(dialog).to_be_visible()
    page.fill("#api-key", "s3cret")
    page.press("#api-key", "Enter")
    expect(page.locator("#model-name")).to_have_text(exactly("keyed"))
    expect(dialog).to_be_hidden()
    with page.expect_request(CHAT) as chat:
        send(page, "hello")
    answer_done(page, 1)
    expect_answers(page, "Welcome back.")
    assert page.evaluate("sessionStorage.getItem('runlm.apiKey')") == "s3cret"
    assert "s3cret" not in page.evaluate("JSON.stringify(localStorage)")
    assert all("s3cret" not in r.url for r in requests)
    assert chat.value.headers.get("authorization") == "Bearer s3cret"
    page.reload()
    expect(page.locator("#model-name")).to_have_text(exactly("keyed"))
    expect(dialog).to_be_hidden()
    expect_answers(page, "Welcome back.")


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
    expect(page.locator("article.msg.assistant .code-block")).to_be_visible()
    expect(page.locator("#model-meta")).not_to_be_empty()  # the header's text is in before it is measured
    assert page.evaluate(OVERFLOW_JS) == {"page": 0, "messages": 0, "bad": []}
    sidebar = page.locator("#sidebar")
    expect(sidebar).to_be_hidden()
    expect(page.locator("#open-sidebar")).to_be_visible()
    page.click("#open-sidebar")
    expect(sidebar).to_be_visible()
    # it slides in: measure where it ends up, not somewhere along the way
    sidebar.evaluate("s => Promise.all(s.getAnimations().map(a => a.finished)).then(() => null)")
    assert sidebar.evaluate("s => s.getBoundingClientRect().right") <= 375
    page.click(".conv-open")
    expect(sidebar).to_be_hidden()  # hidden (visibility) once it has slid out
    send(page, "short question " + "q" * 90)
    answer_done(page, 2)
    page.click("#settings-toggle")
    expect(page.locator("#settings")).to_be_visible()
    assert page.evaluate(OVERFLOW_JS) == {"page": 0, "messages": 0, "bad": []}
    page.click("#settings-toggle")
    expect(page.locator("#settings")).to_be_hidden()
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

    page.route(CHAT, fake_completion)
    expect(page.locator("#attach")).to_be_visible()
    red = _png((220, 20, 20))
    with page.expect_file_chooser() as chooser:
        page.click("#attach")
    chooser.value.set_files([{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    expect(page.locator(".attachment img")).to_be_visible()
    send(page, "What is this?")
    answer_done(page, 1)
    expect_answers(page, "A red square.")
    expect(page.locator("#attachments")).to_be_hidden()
    (body,) = sent
    image_part, text_part = body["messages"][-1]["content"]
    assert text_part == {"type": "text", "text": "What is this?"}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == red
    expect(page.locator("article.msg.user img")).to_have_attribute("src", url)

    blue = _png((20, 20, 220))
    page.evaluate("""b64 => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], 'blue.png', {type: 'image/png'}));
        window.dispatchEvent(new DragEvent('dragenter', {dataTransfer: dt, bubbles: true}));
        window.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
    }""", base64.b64encode(blue).decode())
    expect(page.locator(".attachment img")).to_be_visible()
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


# Text a model (or a pasted document) can send that makes a renderer which backtracks, or scans ahead from every
# opener, quadratic or worse. Each is ~600k characters and ends in END. The quadratic renderer took 0.2-2 s on each
# at 40k characters, so minutes at this size (or a stack overflow for the nesting ones); a linear one takes well
# under a second, so RENDER_BOUND_MS is generous for a loaded machine and still fails any regression.
HOSTILE_CHARS = 600_000
HOSTILE = {
    "emphasis never closed": "*a _a **a ~~a " * (HOSTILE_CHARS // 14),
    "link labels never closed": "[" * HOSTILE_CHARS,
    "image labels never closed": "![" * (HOSTILE_CHARS // 2),
    "heading with a long gap": "# x" + " " * HOSTILE_CHARS + "y",
    "table separator with a long gap": "a|b\n|---" + " " * HOSTILE_CHARS + "x",
    "url with unbalanced parens": "http://a" + ")" * HOSTILE_CHARS,
    "urls with control characters": "http://\x01" * (HOSTILE_CHARS // 8),
    "block quotes nested": "> " * (HOSTILE_CHARS // 2),
    "lists nested": "- " * (HOSTILE_CHARS // 2),
    "ordered lists nested": "1. " * (HOSTILE_CHARS // 3),
    "yaml keys never ending": "```yaml\n" + "a." * (HOSTILE_CHARS // 2) + "\n",
    "css names never ending": "```css\n" + "-x" * (HOSTILE_CHARS // 2) + "\n",
    "html attributes never ending": "```html\n" + "a." * (HOSTILE_CHARS // 2) + "\n",
    "toml blank lines": "```toml\n" + "\n" * HOSTILE_CHARS + "x\n",
    "wide table of short rows": "|" + "a|" * 20_000 + "\n|" + "-|" * 20_000 + "\n" + "|\n" * 20_000,
}
RENDER_BOUND_MS = 10_000
RENDER_LATER_JS = """t => {
  window.__rendered = null;
  setTimeout(() => {
    try {
      const d = document.createElement('div');
      d.appendChild(RunlmMarkdown.render(t));
      window.__rendered = {text: d.textContent.slice(-200)};
    } catch (e) {
      window.__rendered = {error: String(e)};
    }
  });
}"""


@pytest.mark.parametrize("name", list(HOSTILE))
def test_markdown_renderer_is_linear_on_hostile_text(echo_server, open_page, name):
    """The render runs after evaluate returns, so a page stuck in it fails the bounded wait instead of hanging."""
    page = open_page(echo_server.base_url)
    page.evaluate(RENDER_LATER_JS, HOSTILE[name] + " END")
    page.wait_for_function("() => window.__rendered !== null", timeout=RENDER_BOUND_MS)
    rendered = page.evaluate("window.__rendered")
    assert "error" not in rendered, rendered
    assert "END" in rendered["text"], rendered  # the whole text was rendered, to its end
