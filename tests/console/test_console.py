"""The web console in a real headless Chromium, against a real server and the scripted fake
LLM (which does what a user message says: `call <tool> <JSON args>`, `slowly <text>`).
Every test leaves a screenshot under target/console-screenshots/.
"""

import json
import re
import struct
import zlib

from playwright.sync_api import expect

from conftest import Server, create_conversation, http, open_conversation, send, sign_in

def png(width, height, rgb):
    """A valid PNG of one colour."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes(rgb) * width
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(row * height))
            + chunk(b"IEND", b""))


def call(tool, args):
    return f"call {tool} {json.dumps(args)}"


def state(page):
    return page.locator("#state")


def messages(page):
    return page.locator("#messages > li")


def test_a_bad_key_is_refused_with_a_clear_message_then_sign_in_works(page, server):
    page.goto(server.url + "/")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("API key").fill("brk_not-a-real-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_contain_text("401 unauthorized")
    expect(page.locator("#app")).to_be_hidden()
    page.get_by_label("API key").fill(server.key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Conversations")).to_be_visible()
    # The key lives in this tab's session storage: a reload stays signed in.
    page.reload()
    expect(page.get_by_role("heading", name="Conversations")).to_be_visible()
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()


def test_create_list_archive_delete(page, server):
    sign_in(page, server)
    conv = create_conversation(page, slug="console-create", cwd="console-create", system_prompt="Be brief.")
    status, body = http("GET", f"{server.url}/v1/conversations/{conv}", server.key)
    assert status == 200 and body["cwd"].endswith("console-create") and body["system_prompt"] == "Be brief."
    assert body["slug"] == "console-create"
    expect(page.locator("#chat-title")).to_have_text("console-create")
    item = page.locator(f"#conversations li[data-id='{conv}']")
    expect(item).to_be_visible()
    expect(item).to_have_class(re.compile("current"))
    item.get_by_role("button", name=re.compile("^Archive")).click()
    expect(item).to_be_hidden()
    page.get_by_label("Archived").check()
    expect(item).to_be_visible()
    item.get_by_role("button", name=re.compile("^Unarchive")).click()
    expect(item).to_be_hidden()
    page.get_by_label("Archived").uncheck()
    expect(item).to_be_visible()
    page.once("dialog", lambda d: d.accept())
    item.get_by_role("button", name=re.compile("^Delete")).click()
    expect(item).to_be_hidden()
    assert http("GET", f"{server.url}/v1/conversations/{conv}", server.key)[0] == 404
    # A bad cwd is the server's 400, shown by the form.
    page.get_by_text("New conversation", exact=True).click()
    page.get_by_label("Working directory").fill("/etc")
    page.get_by_role("button", name="Create", exact=True).click()
    expect(page.locator("#create-error")).to_contain_text("invalid_request")


def test_create_from_an_agent_and_see_its_version(page, server):
    status, made = http("POST", f"{server.url}/v1/agents", server.key,
                        {"name": "console-agent", "model": "fake-model", "system_prompt": "From the agent."})
    assert status == 201, made
    status, _ = http("PUT", f"{server.url}/v1/agents/console-agent", server.key,
                     {"model": "fake-model", "system_prompt": "Version two."})
    assert status == 200
    sign_in(page, server)
    page.get_by_text("New conversation", exact=True).click()
    page.get_by_label("Agent", exact=True).select_option("console-agent@2")
    # The agent owns its model and prompt.
    expect(page.get_by_label("Model")).to_be_disabled()
    expect(page.get_by_label("System prompt")).to_be_disabled()
    page.get_by_label("Name").fill("from-agent")
    before = page.evaluate("location.hash")
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_function("(before) => location.hash.startsWith('#/c/') && location.hash !== before", arg=before)
    conv = page.evaluate("decodeURIComponent(location.hash.slice(4))")
    open_conversation(page, conv)
    expect(page.locator("#chat-cwd")).to_contain_text("agent console-agent@2")
    status, body = http("GET", f"{server.url}/v1/conversations/{conv}", server.key)
    assert status == 200 and body["agent"] == {"name": "console-agent", "version": 2}
    assert body["system_prompt"] == "Version two." and body["slug"] == "from-agent"


def test_a_tool_using_turn_and_streamed_deltas(page, server):
    sign_in(page, server)
    create_conversation(page)
    send(page, call("bash", {"command": "echo hello-from-the-tool"}))
    tool = page.locator(".tool-call").first
    expect(tool.locator(".tool-name")).to_have_text("bash")
    expect(tool.locator(".status")).to_have_text("ok")
    expect(tool.locator("pre.output")).to_contain_text("hello-from-the-tool")
    expect(state(page)).to_have_text("idle")
    expect(messages(page).last).to_contain_text("done")
    # A slow answer: its words show while it streams, before the message is stored.
    words = "one two three four five six seven eight nine ten eleven twelve"
    send(page, "slowly " + words)
    streaming = page.locator("#streaming")
    expect(streaming).to_contain_text("three")
    assert page.locator("#messages > li[data-type='agent']", has_text="twelve").count() == 0
    expect(page.locator("#messages > li[data-type='agent']", has_text="twelve")).to_be_visible()
    expect(streaming).to_be_hidden()
    # Keyboard: Shift+Enter is a new line, Enter sends.
    box = page.get_by_label("Message")
    box.fill("first line")
    box.press("Shift+Enter")
    box.type("second line")
    box.press("Enter")
    user = page.locator("#messages > li[data-type='user']").last
    expect(user.locator(".text")).to_have_text("first line\nsecond line")


def test_a_retry_shows_its_attempt_and_delay(page, server):
    sign_in(page, server)
    create_conversation(page)
    send(page, "flaky please answer")
    expect(state(page)).to_have_text(re.compile(r"^retrying: attempt \d, in \d+\.\d s \(rate_limit\)$"))
    expect(state(page)).to_have_class(re.compile(r"\bretrying\b"))
    expect(page.locator("#messages li[data-type='agent']")).to_contain_text("done: flaky please answer")
    expect(state(page)).to_have_text("idle")


def test_cancel_mid_tool(page, server):
    sign_in(page, server)
    create_conversation(page)
    cancel = page.get_by_role("button", name="Cancel", exact=True)
    expect(cancel).to_be_disabled()
    send(page, call("bash", {"command": "sleep 60"}))
    expect(state(page)).to_have_text(re.compile("^tool_executing"))
    expect(cancel).to_be_enabled()
    cancel.click()
    expect(page.locator(".tool-call .status")).to_have_text("cancelled")
    expect(state(page)).to_have_text("idle")
    expect(cancel).to_be_disabled()


def test_answer_a_confirm_and_a_select(page, server):
    sign_in(page, server)
    create_conversation(page)
    send(page, call("ask_user", {"question": "Deploy to staging?", "kind": "confirm"}))
    card = page.locator(".request")
    expect(card).to_contain_text("Deploy to staging?")
    expect(card.locator(".countdown")).to_have_text(re.compile(r"\d+ s left"))
    card.get_by_role("button", name="Yes").click()
    expect(card).to_have_count(0)
    expect(page.locator(".tool-call .status").last).to_have_text("ok")
    expect(page.locator("pre.output").last).to_contain_text("yes")

    send(page, call("ask_user", {"question": "Which colour?", "kind": "select", "options": ["red", "green", "blue"]}))
    expect(card).to_contain_text("Which colour?")
    card.get_by_label("green").check()
    card.get_by_role("button", name="Choose").click()
    expect(card).to_have_count(0)
    expect(page.locator("pre.output").last).to_contain_text("green")

    # A prompt answered elsewhere (over REST) leaves this page too.
    send(page, call("ask_user", {"question": "Your name?", "kind": "prompt"}))
    expect(card).to_contain_text("Your name?")
    conv = page.evaluate("decodeURIComponent(location.hash.slice(4))")
    pending = card.get_attribute("data-request-id")
    status, _ = http("POST", f"{server.url}/v1/conversations/{conv}/requests/{pending}", server.key,
                     {"payload": {"text": "Ada"}})
    assert status == 200
    expect(card).to_have_count(0)
    expect(page.locator("pre.output").last).to_contain_text("Ada")


def test_approve_and_deny_a_tool(page, server):
    status, conv = http("POST", f"{server.url}/v1/conversations", server.key, {"require_approval": ["bash"]})
    assert status == 201
    sign_in(page, server)
    page.goto(f"{server.url}/#/c/{conv['id']}")
    open_conversation(page, conv["id"])
    send(page, call("bash", {"command": "echo approved-run"}))
    card = page.locator(".request")
    expect(card.get_by_role("heading")).to_contain_text("Approve bash?")
    expect(card).to_contain_text("echo approved-run")
    # Still an approval after a reload (which replays no events).
    page.reload()
    open_conversation(page, conv["id"])
    expect(card.get_by_role("heading")).to_contain_text("Approve bash?")
    expect(card).to_contain_text("echo approved-run")
    card.get_by_role("button", name="Allow").click()
    expect(card).to_have_count(0)
    expect(page.locator("pre.output").last).to_contain_text("approved-run")
    expect(state(page)).to_have_text("idle")
    send(page, call("bash", {"command": "echo never"}))
    card.get_by_role("button", name="Deny").click()
    expect(page.locator(".tool-call .status").last).to_have_text("failed")
    expect(page.locator("pre.output").last).to_contain_text("denied")


def test_the_trace_steps_through_each_decision_and_jumps_to_its_message(page, server):
    """Issue 40: the timeline of a conversation's core: every step with its event and the
    states before and after, what it started, and a jump from a step to its message."""
    sign_in(page, server)
    create_conversation(page)
    send(page, call("bash", {"command": "echo traced"}))
    expect(page.locator("pre.output").last).to_contain_text("traced")
    expect(state(page)).to_have_text("idle")
    page.get_by_role("button", name="Trace", exact=True).click()
    steps = page.locator("#trace-steps > li")
    expect(steps.first).to_contain_text("user_message: idle")
    expect(page.locator("#trace-summary")).to_contain_text(re.compile(r"^\d+ steps$"))
    count = steps.count()
    assert count >= 5
    # The last step is shown: the final answer, which ends the turn.
    detail = page.locator("#trace-detail")
    expect(detail).to_contain_text(f"Step {count}: llm_response")
    expect(detail).to_contain_text("\u2192 idle")
    # Step back to the tool's result: it stored the result and asked for the next step.
    tool_step = page.locator("#trace-steps > li", has_text="tool_complete").first
    tool_step.click()
    expect(detail).to_contain_text("State: tool_executing")
    expect(detail.locator(".effects")).to_contain_text("persist_message")
    detail.get_by_role("button", name=re.compile(r"^Show message \d+$")).click()
    expect(page.locator(".tool-call.highlight")).to_have_count(1)
    # Arrows step through.
    page.get_by_role("button", name="Previous step").click()
    expect(page.locator("#trace-steps > li[aria-selected='true']")).to_contain_text("llm_response")
    page.get_by_role("button", name="Next step").click()
    expect(page.locator("#trace-steps > li[aria-selected='true']")).to_contain_text("tool_complete")
    page.get_by_role("button", name="Close the trace").click()
    expect(page.locator("#trace-panel")).to_be_hidden()


def test_answer_a_client_tool_call_by_hand(page, server):
    """Issue 38: a pending client tool call is a card with its input and an answer form; it
    is still there after a reload (from the snapshot); its answer is the call's result."""
    status, conv = http("POST", f"{server.url}/v1/conversations", server.key, {"client_tools": [{
        "name": "lookup", "description": "the client's dictionary",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]})
    assert status == 201, conv
    sign_in(page, server)
    page.goto(f"{server.url}/#/c/{conv['id']}")
    open_conversation(page, conv["id"])
    send(page, call("lookup", {"q": "ferrous"}))
    card = page.locator(".request")
    expect(card.get_by_role("heading")).to_contain_text("Client tool: lookup")
    expect(card).to_contain_text("ferrous")
    page.reload()
    open_conversation(page, conv["id"])
    expect(card.get_by_role("heading")).to_contain_text("Client tool: lookup")
    card.get_by_label("The tool's output").fill("iron")
    card.get_by_role("button", name="Send result").click()
    expect(card).to_have_count(0)
    expect(page.locator("pre.output").last).to_contain_text("iron")
    expect(state(page)).to_have_text("idle")


def test_a_message_sent_while_a_turn_runs_waits_in_the_queue(page, server):
    """Issue 39: while a turn runs, a sent message waits for it (if_busy=enqueue) and shows in
    the queue, where it can be taken back; the next one runs when the turn ends."""
    sign_in(page, server)
    create_conversation(page)
    send(page, call("ask_user", {"question": "Ready?", "kind": "confirm"}))
    card = page.locator(".request")
    expect(card).to_contain_text("Ready?")
    send(page, "taken back later")
    queue = page.locator("#queue li")
    expect(queue).to_have_count(1)
    expect(queue).to_contain_text("taken back later")
    queue.get_by_role("button", name="Take back").click()
    expect(queue).to_have_count(0)
    expect(page.locator("#queue-panel")).to_be_hidden()
    send(page, "runs next")
    expect(queue).to_contain_text("runs next")
    card.get_by_role("button", name="Yes").click()
    expect(page.locator("#messages")).to_contain_text("runs next")
    expect(page.locator("#queue-panel")).to_be_hidden()
    expect(state(page)).to_have_text("idle")
    expect(page.locator("#messages")).not_to_contain_text("taken back later")


def test_agent_markdown_is_rendered_and_sanitised(page, server):
    sign_in(page, server)
    create_conversation(page)
    # The fake echoes the message as the agent's answer: Markdown with hostile HTML in it.
    send(page, 'Some **bold** and `code` <img src="x" onerror="window.pwned = 1"> '
               '<input id="text" value="from the agent"> <button id="cancel">x</button> '
               '[a link](javascript:window.pwned=2)')
    answer = page.locator("#messages li[data-type='agent']").last
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("code")).to_have_text("code")
    assert answer.locator("input, button, [onerror]").count() == 0
    for href in answer.locator("a").evaluate_all("as => as.map(a => a.getAttribute('href'))"):
        assert not (href or "").startswith("javascript:"), href
    assert page.evaluate("window.pwned") is None
    # The page's own controls are still its own.
    send(page, "still mine")
    expect(page.locator("#messages li[data-type='user']").last.locator(".text")).to_have_text("still mine")


def test_sub_agent_tree(page, server):
    sign_in(page, server)
    parent = create_conversation(page)
    send(page, call("spawn_sub_agents", {"tasks": [{"prompt": "first sub-task"}, {"prompt": "second sub-task"}]}))
    expect(page.locator(".tool-call .status")).to_have_text("ok")
    children = page.locator("#tree li[data-agent-id]")
    expect(children).to_have_count(2)
    expect(children.locator(".badge")).to_have_text(["completed", "completed"])
    child = children.first.get_attribute("data-agent-id")
    children.first.get_by_role("link").click()
    open_conversation(page, child)
    expect(page.locator("#chat-parent")).to_be_visible()
    expect(page.locator("#messages")).to_contain_text("sub-task")
    expect(page.locator("#composer")).to_be_hidden()
    expect(page.locator("#tree a[aria-current]")).to_have_attribute("data-id", child)
    page.locator("#chat-parent").click()
    expect(page).to_have_url(re.compile(f"#/c/{parent}$"))


def test_background_task_and_its_cancel(page, server):
    sign_in(page, server)
    create_conversation(page)
    send(page, call("bash", {"command": "for i in 1 2 3 4 5 6 7 8 9; do echo line $i; sleep 1; done; sleep 60", "background": True}))
    task = page.locator("#tasks li")
    expect(task).to_have_count(1)
    expect(task.locator(".badge")).to_have_text("running")
    expect(task).to_contain_text("line")
    task.get_by_role("button", name=re.compile("^Cancel task")).click()
    expect(task.locator(".badge")).to_have_text("cancelled")


def test_image_attach_and_thumbnail(page, server, tmp_path):
    sign_in(page, server)
    create_conversation(page)
    image = tmp_path / "red.png"
    image.write_bytes(png(40, 30, (200, 30, 30)))
    page.locator("#file").set_input_files(str(image))
    expect(page.locator("#attachments img")).to_have_count(1)
    send(page, "what is in this picture?")
    thumb = page.locator("#messages li[data-type='user'] .thumbs img")
    expect(thumb).to_have_count(1)
    page.wait_for_function("() => { const i = document.querySelector('.thumbs img'); return i && i.complete && i.naturalWidth > 0; }")
    expect(page.locator("#attachments img")).to_have_count(0)


def test_context_meter_colours(page, server):
    sign_in(page, server)
    create_conversation(page, model="warn-window")
    send(page, "hello")
    expect(page.locator("#context")).to_have_class(re.compile(r"\bwarn\b"))
    expect(page.locator("#context-text")).to_have_text("110 / 130 tokens")
    create_conversation(page, model="danger-window")
    send(page, "hello")
    expect(page.locator("#context")).to_have_class(re.compile(r"\bdanger\b"))


def test_a_full_context_is_continued_in_a_new_conversation(page, server):
    sign_in(page, server)
    # Its window is 112 tokens: the first answer (110) fills it past 90%.
    source = create_conversation(page, model="danger-window")
    send(page, "hello")
    expect(state(page)).to_have_text("context_exhausted")
    page.get_by_role("button", name="Continue in a new conversation").click()
    page.wait_for_function("(source) => !location.hash.endsWith(source)", arg=source)
    conv = page.evaluate("decodeURIComponent(location.hash.slice(4))")
    open_conversation(page, conv)
    first = page.locator("#messages > li[data-type='system']").first
    expect(first).to_contain_text(f"continues conversation {source}")
    expect(page.get_by_role("button", name="Continue in a new conversation")).to_be_hidden()


def test_reconnect_after_the_server_restarts(page, server):
    sign_in(page, server)
    conv = create_conversation(page)
    for i in range(3):
        send(page, f"before restart {i}")
        expect(page.locator("#messages li[data-type='agent']")).to_have_count(i + 1)
    server.restart()
    # The page reconnects by itself and goes on: a message sent after the restart arrives
    # once, after the ones before it.
    page.locator("#chat[data-live]").wait_for(state="attached", timeout=30_000)
    expect(page.locator("#banner")).to_be_hidden()
    send(page, "after restart")
    expect(page.locator("#messages li[data-type='agent']", has_text="after restart")).to_be_visible()
    seqs = page.locator("#messages > li[data-seq]").evaluate_all("ls => ls.map(l => Number(l.dataset.seq))")
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    # Messages sent while the page was away show up once it reconnects: no gap.
    status, _ = http("POST", f"{server.url}/v1/conversations/{conv}/messages", server.key, {"text": "sent elsewhere"})
    assert status == 202
    expect(page.locator("#messages li[data-type='agent']", has_text="sent elsewhere")).to_be_visible()
    # A reload shows the same history, no duplicate.
    page.reload()
    open_conversation(page, conv)
    expect(page.locator("#messages > li[data-seq]")).to_have_count(len(seqs) + 2)
    seqs = page.locator("#messages > li[data-seq]").evaluate_all("ls => ls.map(l => Number(l.dataset.seq))")
    assert seqs == list(range(1, len(seqs) + 1)), seqs


def test_dev_mode_needs_no_key(browser, work, llm, request):
    srv = Server(work / "dev", llm.base_url, auth="dev")
    srv.start()
    try:
        context = browser.new_context()
        pg = context.new_page()
        pg.goto(srv.url + "/")
        expect(pg.get_by_role("heading", name="Conversations")).to_be_visible()
        expect(pg.locator("#mode")).to_contain_text("dev mode")
        expect(pg.get_by_role("button", name="Sign out")).to_be_hidden()
        context.close()
    finally:
        srv.stop()
