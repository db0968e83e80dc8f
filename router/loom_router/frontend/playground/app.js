// Loom's playground: a chat with 1 to 4 answers streamed side by side from
// /v1/chat/completions (n answers, each with its own temperature through `choice_params`).
// Plain DOM, no framework. Model output is only ever set as text (textContent), never HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_ANSWERS = 4;

const state = {
  messages: [],     // the conversation so far: [{role, content}], the system prompt excluded
  turn: null,       // the last user message and its answers, until one is picked
  controller: null, // the AbortController of the request in flight
};

// ---- talking to the server ---------------------------------------------------------------

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body.detail ?? body;
    return typeof error === "string" ? error : error.message ?? JSON.stringify(error);
  } catch {
    return text || response.statusText;
  }
}

function showAuthError(message) {
  const alert = $("auth-error");
  alert.textContent = "401 Unauthorized: this server needs an API key. Enter it in the API key field " +
    "and send again." + (message ? " The server said: " + message : "");
  alert.hidden = false;
  $("api-key").setAttribute("aria-invalid", "true");
}

function clearAuthError() {
  $("auth-error").hidden = true;
  $("api-key").removeAttribute("aria-invalid");
}

async function loadInfo() {
  try {
    const response = await fetch("/info", { headers: requestHeaders() });
    if (response.status === 401) {
      showAuthError(await errorMessage(response));
      $("model-info").textContent = "Model: unknown until the API key is accepted";
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}: ${await errorMessage(response)}`);
    const info = await response.json();
    $("model-info").textContent =
      `Model: ${info.served_model_name ?? info.model_id} · context ${info.max_total_tokens} tokens`;
    $("model-info").dataset.contextTokens = info.max_total_tokens;
    for (const option of $("num-answers").options) option.disabled = Number(option.value) > info.max_n;
  } catch (error) {
    $("model-info").textContent = "Model info unavailable: " + error.message;
  }
}

// Server-sent events from a fetch body: calls onData with each `data:` payload, parsed,
// until the stream ends or sends OpenAI's [DONE].
async function readEvents(body, onData) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

// ---- the page ----------------------------------------------------------------------------

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("answers").setAttribute("aria-busy", String(busy));
}

function addMessage(role, text, note) {
  const item = document.createElement("li");
  item.className = "message " + role;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = note ? `${role} (${note})` : role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  item.append(who, body);
  $("conversation").append(item);
  return item;
}

function temperatures(n) {
  return Array.from({ length: n }, (_, i) => {
    const value = Number($("temp-" + i).value);
    return Number.isFinite(value) ? Math.min(Math.max(value, 0), 2) : 1;
  });
}

function showTemperatures() {
  const n = Number($("num-answers").value);
  for (let i = 0; i < MAX_ANSWERS; i++) $("temp-" + i).parentElement.hidden = i >= n;
}

function answerCard(turn, index, temperature) {
  const card = document.createElement("article");
  card.className = "answer";
  card.dataset.index = index;
  card.setAttribute("aria-label", `Answer ${index + 1}`);
  const title = document.createElement("h3");
  title.textContent = `Answer ${index + 1} · temperature ${temperature}`;
  const text = document.createElement("div");
  text.className = "text";
  text.setAttribute("aria-live", "off");
  const stats = document.createElement("p");
  stats.className = "stats";
  stats.textContent = "waiting…";
  const pickButton = document.createElement("button");
  pickButton.type = "button";
  pickButton.className = "pick";
  pickButton.textContent = `Continue with answer ${index + 1}`;
  pickButton.title = `Alt+${index + 1}`;
  pickButton.disabled = true;
  pickButton.addEventListener("click", () => pick(turn, index));
  card.append(title, text, stats, pickButton);
  const answer = { index, temperature, text: "", numTokens: 0, firstAt: null, lastAt: null,
                   finish: null, error: null, card, textEl: text, statsEl: stats, pickButton };
  return answer;
}

function renderStats(answer, startedAt) {
  const parts = [];
  if (answer.firstAt !== null) parts.push(`TTFT ${Math.round(answer.firstAt - startedAt)} ms`);
  const seconds = (answer.lastAt - answer.firstAt) / 1000;
  if (answer.numTokens > 1 && seconds > 0) parts.push(`${((answer.numTokens - 1) / seconds).toFixed(1)} tokens/s`);
  parts.push(answer.numTokens === 1 ? "1 token" : `${answer.numTokens} tokens`);
  if (answer.finish) parts.push(answer.finish);
  if (answer.error) parts.push("error: " + answer.error);
  answer.statsEl.textContent = parts.join(" · ");
}

function onChunk(turn, chunk) {
  if (chunk.error) throw new Error(chunk.error.message ?? String(chunk.error));
  const now = performance.now();
  for (const choice of chunk.choices ?? []) {
    const answer = turn.answers[choice.index];
    const delta = choice.delta ?? {};
    if (!answer || "role" in delta) continue; // the opening chunk of each answer carries no token
    answer.firstAt ??= now;
    answer.lastAt = now;
    answer.numTokens += 1;
    if (delta.content) {
      answer.text += delta.content;
      answer.textEl.textContent = answer.text; // text, never HTML
    }
    if (choice.finish_reason) answer.finish = choice.finish_reason;
    renderStats(answer, turn.startedAt);
  }
}

function endTurn(turn, outcome, error) {
  for (const answer of turn.answers) {
    if (!answer.finish) answer.finish = outcome;
    if (error && !answer.text) answer.error = error;
    answer.pickButton.disabled = !answer.text;
    answer.card.classList.remove("streaming");
    renderStats(answer, turn.startedAt);
  }
}

function pick(turn, index) {
  if (state.turn !== turn || turn.picked || state.controller) return;
  const answer = turn.answers[index];
  turn.picked = true;
  state.messages.push({ role: "user", content: turn.userText }, { role: "assistant", content: answer.text });
  turn.userItem.classList.remove("pending");
  addMessage("assistant", answer.text, `answer ${index + 1}, temperature ${answer.temperature}`);
  $("answers").replaceChildren();
  setStatus(`Continuing with answer ${index + 1}.`);
  $("prompt").focus();
}

// The last turn must be settled before the next: pick an answer, or drop a turn that has none.
function settleLastTurn() {
  const turn = state.turn;
  if (!turn || turn.picked) return true;
  if (turn.answers.some((a) => a.text)) {
    setStatus("Pick the answer to continue with first (the buttons under the answers, or Alt+1…4).");
    turn.answers.find((a) => a.text).pickButton.focus();
    return false;
  }
  turn.userItem.remove();
  $("answers").replaceChildren();
  state.turn = null;
  return true;
}

function buildRequest(userText, temps) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.messages, { role: "user", content: userText });
  const body = { messages, n: temps.length, stream: true, choice_params: temps.map((t) => ({ temperature: t })) };
  const maxTokens = Number($("max-tokens").value);
  if (Number.isInteger(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  if ($("json-mode").checked) body.response_format = { type: "json_object" };
  return body;
}

function startTurn(userText, temps) {
  const turn = { userText, answers: [], picked: false, startedAt: performance.now() };
  turn.userItem = addMessage("user", userText);
  turn.userItem.classList.add("pending");
  turn.answers = temps.map((t, i) => answerCard(turn, i, t));
  const container = $("answers");
  container.style.setProperty("--num-answers", temps.length);
  container.replaceChildren(...turn.answers.map((a) => a.card));
  for (const answer of turn.answers) answer.card.classList.add("streaming");
  state.turn = turn;
  return turn;
}

async function send() {
  if (state.controller) return;
  const userText = $("prompt").value.trim();
  if (!userText) {
    setStatus("Type a message first.");
    return;
  }
  if (!settleLastTurn()) return;
  const temps = temperatures(Number($("num-answers").value));
  const body = buildRequest(userText, temps);
  $("prompt").value = "";
  const turn = startTurn(userText, temps);
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  setStatus("Generating…");
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) {
      const message = await errorMessage(response);
      if (response.status === 401) showAuthError(message);
      throw new Error(`HTTP ${response.status}: ${message}`);
    }
    clearAuthError();
    await readEvents(response.body, (chunk) => onChunk(turn, chunk));
    endTurn(turn, "ended");
    setStatus(temps.length > 1 ? "Done. Pick the answer to continue with." : "Done.");
  } catch (error) {
    const stopped = error.name === "AbortError";
    endTurn(turn, stopped ? "stopped" : "error", stopped ? null : error.message);
    setStatus(stopped ? "Stopped." : "Failed: " + error.message);
    if (!turn.answers.some((a) => a.text) && !$("prompt").value) $("prompt").value = userText;
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (temps.length === 1 && turn.answers[0].text && turn.answers[0].finish !== "stopped") pick(turn, 0);
}

function stop() {
  if (state.controller) state.controller.abort(); // the server cancels the request on disconnect
}

function newChat() {
  stop();
  state.messages = [];
  state.turn = null;
  $("conversation").replaceChildren();
  $("answers").replaceChildren();
  setStatus("New conversation.");
  $("prompt").focus();
}

function onKey(event) {
  if (event.key === "Escape" && state.controller) {
    event.preventDefault();
    stop();
  } else if (event.altKey && event.key >= "1" && event.key <= String(MAX_ANSWERS) && state.turn) {
    const answer = state.turn.answers[Number(event.key) - 1];
    if (answer && !answer.pickButton.disabled) {
      event.preventDefault();
      pick(state.turn, answer.index);
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("num-answers").addEventListener("change", showTemperatures);
  $("api-key").addEventListener("change", () => {
    clearAuthError();
    loadInfo();
  });
  document.addEventListener("keydown", onKey);
  showTemperatures();
  loadInfo();
  $("prompt").focus();
});
