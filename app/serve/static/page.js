// The page at /: a chat streamed from /v1/chat/completions, and beside it the engine as
// /engine reports it (app/serve/scheduler.py: Scheduler.view), polled a few times a second.
// No libraries and nothing from the network but this server: it works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];                 // the conversation: [{role, content}]
let controller = null;              // the running request's AbortController (Stop)

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

// Server-sent events, read from a fetch body: "data: {...}" lines, blank-line separated.
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const reply = bubble("assistant", "");
  reply.classList.add("streaming");
  $("send").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const t0 = performance.now();
  let n = 0;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages: history, stream: true, stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value) || 128, temperature: Number($("temperature").value) || 0,
      }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    let usage = null;
    for await (const data of sse(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) { reply.textContent += piece; n += 1; reply.scrollIntoView({ block: "end" }); }
      }
    }
    history.push({ role: "assistant", content: reply.textContent });
    const s = (performance.now() - t0) / 1000;
    const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    $("status").textContent = usage
      ? `${usage.prompt_tokens} prompt tokens (${cached} from cached pages), ${usage.completion_tokens} generated in ${s.toFixed(1)} s`
      : `${n} pieces in ${s.toFixed(1)} s`;
  } catch (e) {
    if (e.name === "AbortError") {
      history.push({ role: "assistant", content: reply.textContent });
      $("status").textContent = "stopped";
    } else {
      history.pop();
      reply.classList.add("error");
      reply.textContent += (reply.textContent ? "\n" : "") + e.message;
    }
  } finally {
    reply.classList.remove("streaming");
    reply.classList.add("done");
    $("send").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

$("ask").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("reset").addEventListener("click", () => { history.length = 0; $("messages").textContent = ""; $("status").textContent = ""; });
$("key").value = localStorage.getItem("api-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("api-key", $("key").value));

// ---- the engine ----------------------------------------------------------------------------
function colour(id) {                 // a stable colour per sequence id
  return `hsl(${(id * 137.508) % 360} 65% 55%)`;
}

let last = null;                      // the previous poll: {t, generated, drafted, accepted}
function draw(view) {
  $("model").textContent = view.model;
  $("stage").textContent = `stage ${view.stage}${view.draining ? " (draining)" : ""}`;
  const now = performance.now();
  if (last && now > last.t) {
    const rate = Math.max(0, view.generated_tokens - last.generated) / ((now - last.t) / 1000);
    $("tps").textContent = rate.toFixed(rate < 10 ? 1 : 0);
  }
  drawAcceptRate(view, last);
  last = { t: now, generated: view.generated_tokens, drafted: view.drafted, accepted: view.accepted };
  $("running").textContent = view.running;
  $("waiting").textContent = view.waiting;
  $("preemptions").textContent = view.preemptions;

  const rows = view.recent_rows, top = Math.max(1, ...rows);
  const bars = $("rows");
  bars.textContent = "";
  for (const r of rows) {
    const bar = document.createElement("div");
    bar.style.height = `${(100 * r) / top}%`;
    bar.title = `${r} rows`;
    bars.appendChild(bar);
  }
  bars.title = `up to ${top} rows per step`;

  const pool = $("pool"), owners = view.page_owner, shared = new Set(view.page_shared);
  if (pool.children.length !== owners.length) {
    pool.textContent = "";
    for (let i = 0; i < owners.length; i++) {
      const cell = document.createElement("span");
      cell.className = "page";
      pool.appendChild(cell);
    }
  }
  owners.forEach((owner, i) => {
    const cell = pool.children[i];
    cell.dataset.owner = owner;
    cell.className = "page " + (owner > 0 ? "owned" : owner < 0 ? "cached" : "free") + (shared.has(i) ? " shared" : "");
    cell.style.background = owner > 0 ? colour(owner) : "";
    cell.title = owner > 0 ? `page ${i}: sequence ${owner}${shared.has(i) ? " and others (shared)" : ""}`
      : owner < 0 ? `page ${i}: free, holds a cached prefix` : `page ${i}: free`;
  });
  const used = view.kv_pages_total - view.kv_pages_free;
  $("pool-caption").textContent = `(${used} of ${view.kv_pages_total} pages of ${view.kv_page_size} positions held, ${view.page_shared.length} shared)`;

  const body = $("sequences").tBodies[0];
  body.textContent = "";
  for (const s of view.sequences) {
    const tr = body.insertRow();
    for (const v of [s.id, s.tokens, s.pages, s.preemptions]) tr.insertCell().textContent = v;
    tr.cells[0].style.color = colour(s.id);
  }
}

// speculative decoding (serve --spec): the share of guesses kept since the last poll, else overall
function drawAcceptRate(view, before) {
  $("spec").hidden = !view.spec;
  if (!view.spec) return;
  const drafted = view.drafted - (before ? before.drafted : 0), accepted = view.accepted - (before ? before.accepted : 0);
  const [made, kept] = drafted > 0 ? [drafted, accepted] : [view.drafted, view.accepted];
  $("accept").textContent = made > 0 ? `${Math.round((100 * kept) / made)}%` : "-";
  $("spec").title = `${view.accepted} of ${view.drafted} guessed tokens kept since the server started`;
}

async function poll() {
  try {
    const response = await fetch("/engine", { headers: headers() });
    if (response.ok) draw(await response.json());
    else $("stage").textContent = await errorText(response);
  } catch (e) {
    $("stage").textContent = "the server is not answering";
  }
  setTimeout(poll, 250);
}
poll();
