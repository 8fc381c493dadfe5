/* Live parts of a page, pushed (docs/live.md, "The dashboard and the bell").
 *
 * One EventSource per page (body's data-events-url): the change feed (GET /events/), or on a
 * job page the job's stream (GET /jobs/<id>/events/), which also carries the log. An element
 * marked data-live="<topics>" data-live-url="<partial>" is read again when one of its topics
 * comes (only for its server's, where it says data-live-server="<id>" and the message names a
 * server), at most once a second per page, and the fresh partial is patched into it in place:
 * texts, attributes and bar widths change, elements stay, so the one holding focus keeps it.
 * Where the structure changed (a server or card came or went) the part is replaced only when
 * focus is not inside it; else it waits until focus leaves.
 *
 * Other scripts take events through window.portalLive: on(type, fn) for any event of the
 * stream, onFallback(fn) for when the page gives the stream up. A tab hidden for HIDDEN_MS lets
 * its stream go (a browser opens six connections to a host over HTTP/1.1, and background tabs
 * would hold them all); shown again, it reconnects from the last event's id and reads its live
 * parts once.
 *
 * While the stream is not up (no EventSource, refused: e.g. served over WSGI, or failing), the
 * elements' own htmx polling runs (each marked data-poll-fallback: its requests are let through
 * only while portalLive.polls; no trigger filter, which htmx would eval), its answers are
 * patched in the same way, and an element marked data-live-status says so.
 */
(function () {
  "use strict";
  const TOPICS = ["telemetry", "bookings", "jobs", "notifications", "job"];
  const MIN_GAP_MS = 1000;
  const MAX_FAILURES = 3;
  const HIDDEN_MS = 10000;
  const listeners = {}; // event type → functions, attached to every stream this page opens
  const fallbacks = [];
  let stream = null;
  let gaveUp = "";
  let failures = 0; // errors since the last `ready`
  let missed = false;
  let lastId = "";
  // The change count as this page's request began (base.html): a `ready` that says more means a
  // change came between the page's render and its stream's start, which no event brought.
  let seenAtRender = document.body ? document.body.dataset.changesSeen || "" : "";
  let hiddenTimer = null;
  let started = false; // the stream is opened once the page's scripts have run (the end)
  const live = (window.portalLive = {
    up: false,
    // Whether this page has a stream at all (else every part polls from the start).
    streams: !!(window.EventSource && document.body && document.body.dataset.eventsUrl),
    // Whether the parts poll: the stream is given up, or reconnecting after an error; not while
    // it first connects, nor while a hidden tab rests.
    get polls() {
      return !this.streams || !!gaveUp || (stream !== null && !this.up && failures > 0);
    },
    on(type, fn) {
      (listeners[type] = listeners[type] || []).push(fn);
      if (stream) stream.addEventListener(type, fn);
    },
    onFallback(fn) {
      fallbacks.push(fn);
      if (gaveUp) fn(gaveUp);
    },
  });

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
    if (!fresh) return;
    // htmx reads a part's polling when it first sees it: a part that starts or stops polling
    // (a job that ended) is replaced and shown to htmx, where focus allows.
    const polling = (n) => `${n.getAttribute("hx-get")} ${n.getAttribute("hx-trigger")}`;
    if (polling(el) !== polling(fresh) && !focusIn([el])) {
      const node = document.importNode(fresh, true);
      el.replaceWith(node);
      if (window.htmx) window.htmx.process(node);
      return;
    }
    if (patch(el, fresh) === false || el.liveWaiting) return;
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

  // A part's polling is the fallback: its requests go only while the stream is not up.
  document.addEventListener("htmx:confirm", (e) => {
    const el = e.detail.elt;
    if (el && el.hasAttribute && el.hasAttribute("data-poll-fallback") && !live.polls) e.preventDefault();
  });

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

  function partsFor(topic, server) {
    return Array.from(document.querySelectorAll(`[data-live~="${topic}"]`)).filter(
      (el) => server == null || !el.dataset.liveServer || el.dataset.liveServer === String(server),
    );
  }

  function serverOf(event) {
    try {
      return JSON.parse(event.data).server;
    } catch (err) {
      return null;
    }
  }

  const url = document.body.dataset.eventsUrl;
  if (!url) return;
  if (!window.EventSource) {
    say("poll");
    return;
  }
  function giveUp(why) {
    stream.close();
    stream = null;
    live.up = false;
    gaveUp = why;
    say("poll");
    fallbacks.forEach((fn) => fn(why));
  }

  function open() {
    // A new EventSource sends no Last-Event-ID: the offset goes in the URL instead.
    const at = lastId ? `${url}${url.includes("?") ? "&" : "?"}offset=${encodeURIComponent(lastId)}` : url;
    stream = new EventSource(at);
    stream.addEventListener("ready", (e) => {
      failures = 0;
      live.up = true;
      say("push");
      const behind = seenAtRender !== null && !(seenAtRender !== "" && e.data !== "" && Number(e.data) <= Number(seenAtRender));
      seenAtRender = null; // the first `ready` only: after that, `missed` tells
      if (missed || behind) schedule(TOPICS.flatMap((topic) => partsFor(topic))); // what came meanwhile
      missed = false;
    });
    stream.addEventListener("message", (e) => {
      if (e.lastEventId) lastId = e.lastEventId;
    });
    stream.onerror = () => {
      live.up = false;
      missed = true;
      failures += 1;
      if (stream.readyState === EventSource.CLOSED) giveUp("the live stream was refused (this portal may not serve it)");
      else if (failures >= MAX_FAILURES) giveUp("the live stream keeps failing");
    };
    for (const topic of TOPICS) {
      stream.addEventListener(topic, (e) => schedule(partsFor(topic, serverOf(e))));
    }
    for (const [type, fns] of Object.entries(listeners)) fns.forEach((fn) => stream.addEventListener(type, fn));
  }

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      if (stream && !hiddenTimer) {
        hiddenTimer = setTimeout(() => {
          hiddenTimer = null;
          if (!stream) return;
          stream.close(); // not given up: it opens again once the tab is shown
          stream = null;
          live.up = false;
          missed = true;
        }, HIDDEN_MS);
      }
    } else {
      clearTimeout(hiddenTimer);
      hiddenTimer = null;
      if (started && !stream && !gaveUp) open();
    }
  });
  // Not before the page's other scripts have said what they listen to: they are deferred too, and
  // a deferred script runs only once it has arrived, so one still on its way (job_log.js on a slow
  // first load) would miss the first events (`ready`, the log's opening lines: gone for good, as
  // its offset then starts past them). DOMContentLoaded comes after every deferred script ran.
  function start() {
    if (started) return;
    started = true;
    open();
  }
  if (document.readyState === "complete") start();
  else {
    document.addEventListener("DOMContentLoaded", start);
    window.addEventListener("load", start); // added after DOMContentLoaded (not done here): still opens
  }
})();
