"""The chat page served at `/`: one static HTML file with its script, talking to /v1/chat/completions with
streaming. `/?prompt=TEXT` fills the input box, `&send=1` sends it at once (links that start a chat);
`temperature=` and `max_tokens=` preset those fields."""

CHAT_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fnx chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; }
  header { padding: .5rem 1rem; background: #223; color: #eee; display: flex; gap: 1rem; align-items: center; }
  header label { font-size: .85rem; }
  header input { width: 4.5rem; }
  #messages { flex: 1; overflow-y: auto; padding: 1rem; }
  .msg { margin: .5rem 0; padding: .5rem .75rem; border-radius: .5rem; white-space: pre-wrap; max-width: 48rem; }
  .user { background: #def; margin-left: auto; }
  .assistant { background: #f3f3f3; }
  .reasoning { color: #666; font-size: .9rem; }
  .reasoning:empty, details:has(> .reasoning:empty) { display: none; }
  form { display: flex; gap: .5rem; padding: .75rem 1rem; border-top: 1px solid #ccc; }
  textarea { flex: 1; height: 3.5rem; font: inherit; }
  #status { font-size: .85rem; color: #aab; margin-left: auto; }
</style>
</head>
<body data-state="idle">
<header>
  <strong>fnx</strong><span id="model"></span>
  <label>temperature <input id="temperature" type="number" min="0" step="0.1" value="0.7"></label>
  <label>max tokens <input id="max_tokens" type="number" min="1" value="512"></label>
  <button id="clear" type="button">clear</button>
  <span id="status">idle</span>
</header>
<div id="messages"></div>
<form id="form">
  <textarea id="input" placeholder="Message (Enter sends, Shift+Enter for a new line)"></textarea>
  <button id="send" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const turns = [];
let controller = null;

function setState(state, text) {
  document.body.dataset.state = state;
  $("status").textContent = text || state;
  $("send").disabled = state === "streaming";
  $("stop").disabled = state !== "streaming";
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (role === "assistant") {
    const details = document.createElement("details");
    details.innerHTML = "<summary>reasoning</summary>";
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    details.appendChild(reasoning);
    const content = document.createElement("div");
    content.className = "content";
    div.append(details, content);
  }
  $("messages").appendChild(div);
  return div;
}

// Parse a text/event-stream body: yields the JSON of each `data:` event until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  turns.push({ role: "user", content: text });
  bubble("user").textContent = text;
  const out = bubble("assistant");
  const content = out.querySelector(".content"), reasoning = out.querySelector(".reasoning");
  controller = new AbortController();
  setState("streaming");
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: controller.signal,
      body: JSON.stringify({
        messages: turns, stream: true,
        temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value),
      }),
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    let finish = null;
    for await (const ev of events(response)) {
      if (ev.error) throw new Error(ev.error.message);
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.reasoning_content) reasoning.textContent += d.reasoning_content;
      if (d.content) { answer += d.content; content.textContent = answer; }
      if (d.tool_calls) content.textContent += "\n[tool call] " + JSON.stringify(d.tool_calls);
      if (choice.finish_reason) finish = choice.finish_reason;
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    turns.push({ role: "assistant", content: answer });
    setState("done", "done (" + finish + ")");
  } catch (e) {
    if (e.name === "AbortError") {
      turns.push({ role: "assistant", content: answer });
      setState("stopped");
    } else {
      content.textContent += "\n[error] " + e.message;
      setState("error", "error: " + e.message);
    }
  } finally {
    controller = null;
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => { turns.length = 0; $("messages").innerHTML = ""; setState("idle"); });

fetch("/v1/models").then((r) => r.json()).then((m) => { $("model").textContent = m.data[0].id; }).catch(() => {});
const params = new URLSearchParams(location.search);
for (const k of ["temperature", "max_tokens"]) if (params.has(k)) $(k).value = params.get(k);
if (params.has("prompt")) {
  $("input").value = params.get("prompt");
  if (params.get("send") === "1") $("form").requestSubmit();
}
</script>
</body>
</html>
"""
