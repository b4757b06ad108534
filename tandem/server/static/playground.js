// tandem playground: streams /v1/chat/completions (SSE over fetch), shows the last reply's TTFT and
// tokens/s and the server's running/waiting counts from /metrics. No framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "tandem.apiKey";
const SETTINGS_STORAGE = "tandem.settings";
const SETTING_IDS = ["system", "temperature", "top-p", "max-tokens", "seed"];

const state = {
  model: null,       // the served model name from /v1/models
  messages: [],      // [{role: "user" | "assistant", content}] of the conversation
  controller: null,  // AbortController of the reply being streamed, null when idle
  conversation: 0,   // bumped by "Clear chat", so that a reply cut by it is not added to the new chat
};

// ---- settings kept in localStorage ----------------------------------------------------------

function loadSettings() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}"); } catch (e) { saved = {}; }
  for (const id of SETTING_IDS) if (typeof saved[id] === "string") $(id).value = saved[id];
}

function saveSettings() {
  localStorage.setItem(KEY_STORAGE, $("api-key").value);
  const values = {};
  for (const id of SETTING_IDS) values[id] = $(id).value;
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ---- errors ---------------------------------------------------------------------------------

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").textContent = "";
  $("error").hidden = true;
}

// The server's message verbatim: every error body is {"error": {"message": ...}} (OpenAI's shape).
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (e) { /* not JSON: show the text as it came */ }
  return `HTTP ${response.status}: ${text || response.statusText}`;
}

function needKey(needed) {
  $("api-key-row").classList.toggle("needed", needed);
  if (needed) openSettings(true);
}

// ---- server state ---------------------------------------------------------------------------

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      needKey(true);
      $("model-name").textContent = "(API key needed)";
      showError(await errorMessage(r));
      return;
    }
    if (!r.ok) { showError(await errorMessage(r)); return; }
    needKey(false);
    const body = await r.json();
    state.model = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = state.model || "(no model)";
    clearError();
  } catch (e) {
    showError("cannot reach the server: " + e.message);
  }
}

function metricValue(text, name) {
  // Prometheus text format: "name value" or "name{labels} value" per line.
  for (const line of text.split("\n")) {
    if (line.startsWith(name + " ") || line.startsWith(name + "{")) {
      return Number(line.slice(line.lastIndexOf(" ") + 1));
    }
  }
  return null;
}

async function pollMetrics() {
  try {
    const r = await fetch("/metrics", { headers: headers() });
    if (r.ok) {
      const text = await r.text();
      const running = metricValue(text, "tandem_num_requests_running");
      const waiting = metricValue(text, "tandem_num_requests_waiting");
      $("server-running").textContent = running === null ? "–" : String(running);
      $("server-waiting").textContent = waiting === null ? "–" : String(waiting);
    }
  } catch (e) { /* the server is away; the chat shows its own error */ }
  setTimeout(pollMetrics, state.controller ? 500 : 2000);
}

// ---- chat -----------------------------------------------------------------------------------

function addMessage(role, content) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = content;
  div.append(label, body);
  $("messages").append(div);
  scrollDown();
  return div;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function render() {
  $("messages").replaceChildren();
  for (const m of state.messages) addMessage(m.role, m.content);
}

function requestBody() {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of state.messages) body.messages.push({ role: m.role, content: m.content });
  // Values go to the server as typed: it validates them and its message is shown if one is wrong.
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const fields = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
  for (const [field, id] of Object.entries(fields)) {
    const v = number(id);
    if (v !== null && !Number.isNaN(v)) body[field] = v;
  }
  return body;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "user");
}

// Splits an SSE byte stream into the payloads of its "data:" lines.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }
}

async function reply() {
  clearError();
  const controller = new AbortController();
  const conversation = state.conversation;
  state.controller = controller;
  setBusy(true);
  const entry = { role: "assistant", content: "" };
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const content = div.querySelector(".content");
  const sent = performance.now();
  let first = null, last = null, chunks = 0, tokens = null, finish = null;
  $("stats-last").textContent = "waiting for the first token…";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!r.ok) {
      if (r.status === 401) needKey(true);
      div.remove();
      showError(await errorMessage(r));
      $("stats-last").textContent = "";
      return;
    }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { showError(chunk.error.message); break; }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        const now = performance.now();
        if (first === null) first = now;
        last = now;
        chunks += 1;
        entry.content += delta;
        content.textContent = entry.content;
        scrollDown();
        showStats(sent, first, last, tokens ?? chunks, null);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    showStats(sent, first, last, tokens ?? chunks, finish);
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
      showStats(sent, first, last, chunks, finish);
    } else {
      showError("the request failed: " + e.message);
    }
  } finally {
    div.classList.remove("streaming");
    if (finish === "stopped") {
      const note = document.createElement("span");
      note.className = "note";
      note.textContent = "(stopped)";
      div.append(note);
    }
    if (conversation === state.conversation && div.isConnected) state.messages.push(entry);
    state.controller = null;
    setBusy(false);
  }
}

function showStats(sent, first, last, tokens, finish) {
  const parts = [];
  if (first !== null) parts.push(`TTFT ${(first - sent).toFixed(0)} ms`);
  parts.push(`${tokens} tokens`);
  // Decode rate: tokens after the first over the time since the first (the usual definition).
  if (first !== null && last > first && tokens > 1) {
    parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tok/s`);
  }
  if (finish) parts.push(`finish: ${finish}`);
  $("stats-last").textContent = parts.join(" · ");
}

function send(event) {
  event.preventDefault();
  if (state.controller) return;
  const text = $("input").value.trim();
  if (!text) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  reply();
}

function regenerate() {
  if (state.controller) return;
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
    state.messages.pop();
  }
  if (!state.messages.length) return;
  render();
  reply();
}

function openSettings(open) {
  $("settings").classList.toggle("open", open);
  $("toggle-settings").setAttribute("aria-expanded", String(open));
}

function init() {
  loadSettings();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.conversation += 1;
    state.messages = [];
    render();
    clearError();
    $("stats-last").textContent = "";
    setBusy(false);
  });
  $("toggle-settings").addEventListener("click", () => openSettings(!$("settings").classList.contains("open")));
  for (const id of SETTING_IDS) $(id).addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", () => { saveSettings(); loadModel(); });
  setBusy(false);
  loadModel();
  pollMetrics();
}

init();
