/* Live parts of a page, pushed (docs/live.md, "The dashboard and the bell").
 *
 * One EventSource per page on the change feed (GET /events/). An element marked
 * data-live="<topics>" data-live-url="<partial>" is read again when one of its topics comes,
 * at most once a second per page, and the fresh partial is patched into it in place: texts,
 * attributes and bar widths change, elements stay, so the one holding focus keeps it. Where
 * the structure changed (a server or card came or went) the part is replaced only when focus
 * is not inside it; else it waits until focus leaves.
 *
 * While the stream is not up (no EventSource, refused: e.g. served over WSGI, or failing), the
 * elements' own htmx polling runs (its trigger's filter reads portalLive.up), its answers are
 * patched in the same way, and an element marked data-live-status says so.
 */
(function () {
  "use strict";
  const TOPICS = ["telemetry", "bookings", "jobs", "notifications"];
  const MIN_GAP_MS = 1000;
  const MAX_FAILURES = 3;
  const live = (window.portalLive = { up: false });

  function focusIn(nodes) {
    const active = document.activeElement;
    return !!active && active !== document.body && nodes.some((n) => n.contains(active));
  }

  function key(node) {
    if (node.nodeType !== Node.ELEMENT_NODE) return "";
    return node.id || node.getAttribute("data-server") || node.getAttribute("data-gpu-uuid") || "";
  }

  // Make `old` look like `fresh`; true when a part that holds focus was left to wait.
  function patch(old, fresh) {
    if (old.nodeType !== fresh.nodeType || old.nodeName !== fresh.nodeName || key(old) !== key(fresh)) {
      if (focusIn([old])) return true;
      old.replaceWith(document.importNode(fresh, true));
      return false;
    }
    if (old.nodeType !== Node.ELEMENT_NODE) {
      if (old.nodeValue !== fresh.nodeValue) old.nodeValue = fresh.nodeValue;
      return false;
    }
    for (const a of Array.from(old.attributes)) if (!fresh.hasAttribute(a.name)) old.removeAttribute(a.name);
    for (const a of Array.from(fresh.attributes)) if (old.getAttribute(a.name) !== a.value) old.setAttribute(a.name, a.value);
    const was = Array.from(old.childNodes);
    const now = Array.from(fresh.childNodes);
    if (was.length !== now.length) {
      if (focusIn(was)) return true;
      old.replaceChildren(...now.map((n) => document.importNode(n, true)));
      return false;
    }
    let waiting = false;
    for (let i = 0; i < was.length; i++) waiting = patch(was[i], now[i]) || waiting;
    return waiting;
  }

  function patchFrom(el, html) {
    const template = document.createElement("template");
    template.innerHTML = html.trim();
    const fresh = template.content.firstElementChild;
    if (!fresh || patch(el, fresh) === false || el.liveWaiting) return;
    el.liveWaiting = true; // the rest, once focus leaves
    el.addEventListener("focusout", () => {
      el.liveWaiting = false;
      schedule([el]);
    }, { once: true });
  }

  async function refresh(el) {
    try {
      const response = await fetch(el.dataset.liveUrl, { headers: { "HX-Request": "true" }, credentials: "same-origin" });
      if (response.status === 200) patchFrom(el, await response.text());
    } catch (err) {
      /* the next change or poll tries again */
    }
  }

  const pending = new Set();
  let timer = null;
  let last = 0;
  function schedule(parts) {
    for (const part of parts) pending.add(part);
    if (timer || !pending.size) return;
    timer = setTimeout(() => {
      timer = null;
      last = Date.now();
      const due = Array.from(pending);
      pending.clear();
      due.forEach(refresh);
    }, Math.max(0, last + MIN_GAP_MS - Date.now()));
  }

  // Polling (the fallback) goes through htmx: patch its answers in place too.
  document.addEventListener("htmx:beforeSwap", (e) => {
    const el = e.detail.target;
    if (!el || !el.hasAttribute || !el.hasAttribute("data-live")) return;
    e.detail.shouldSwap = false;
    if (e.detail.xhr.status === 200) patchFrom(el, e.detail.serverResponse);
  });

  function say(text) {
    document.querySelectorAll("[data-live-status]").forEach((el) => {
      el.textContent = el.getAttribute(text === "push" ? "data-live-push" : "data-live-poll") || el.textContent;
    });
  }

  function partsFor(topic) {
    return Array.from(document.querySelectorAll(`[data-live~="${topic}"]`));
  }

  const url = document.body.dataset.eventsUrl;
  if (!url) return;
  if (!window.EventSource) {
    say("poll");
    return;
  }
  const stream = new EventSource(url);
  let failures = 0;
  let missed = false;
  stream.addEventListener("ready", () => {
    failures = 0;
    live.up = true;
    say("push");
    if (missed) schedule(TOPICS.flatMap(partsFor)); // what came while it was down
    missed = false;
  });
  stream.onerror = () => {
    live.up = false;
    missed = true;
    failures += 1;
    if (stream.readyState === EventSource.CLOSED || failures >= MAX_FAILURES) {
      stream.close();
      say("poll");
    }
  };
  for (const topic of TOPICS) {
    stream.addEventListener(topic, () => schedule(partsFor(topic)));
  }
})();
