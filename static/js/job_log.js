// The live log viewer of a job page: <pre id="job-log" data-log-url=… data-page-stream
// data-offset="0">.
//
// The page's one event stream (static/js/live.js; GET /jobs/<id>/events/, docs/live.md) brings
// each line as the job prints it: an event's data is whole lines, its id the byte offset after
// them, and a reconnect resumes after the last one. At `end` one fetch of the log's endpoint
// brings the final status and any last byte; when the page gives the stream up (refused, or
// failing) the polling below takes over from the same offset, saying so.
//
// Polls `logUrl?offset=N` once a second while the job is active (X-Job-Status queued,
// starting or running), appends the new bytes as text (never as HTML: the log is
// whatever the script printed), and continues at X-Log-Next-Offset. When the status is
// final it fetches once more (lines written between the last poll and the end), then
// stops and sets data-done="1" on the <pre>. No libraries.
(function () {
  "use strict";

  var ACTIVE = { queued: true, starting: true, running: true };
  var POLL_MS = 1000;
  var RETRY_MS = 3000;
  var LABELS = {
    queued: "queued: waiting for the worker",
    starting: "starting",
    running: "running",
    succeeded: "succeeded",
    failed: "failed",
    cancelled: "cancelled",
    timed_out: "timed out",
    lost: "lost",
  };

  function start(pre) {
    var url = pre.getAttribute("data-log-url");
    var offset = parseInt(pre.getAttribute("data-offset") || "0", 10) || 0;
    var statusText = document.getElementById(pre.getAttribute("data-status-text") || "job-log-status");
    // Offsets are bytes; a multi-byte character may straddle two responses, so decode as a stream.
    var decoder = new TextDecoder("utf-8");
    var finalSeen = false;
    var pollingWhy = ""; // why the page polls rather than streams, said beside the status

    function say(text) {
      if (statusText) statusText.textContent = text;
    }

    function atBottom() {
      return pre.scrollHeight - pre.scrollTop - pre.clientHeight < 8;
    }

    function append(text) {
      if (!text) return;
      var follow = atBottom();
      // A text node is the textContent of the <pre> grown by `text`: no markup is parsed,
      // and unlike `textContent +=` the text already shown is not copied again each second.
      pre.appendChild(document.createTextNode(text));
      if (follow) pre.scrollTop = pre.scrollHeight;
    }

    function finish(status) {
      append(decoder.decode());
      pre.setAttribute("data-done", "1");
      say("finished: " + (LABELS[status] || status) + " · " + offset.toLocaleString() + " bytes");
    }

    function tick() {
      fetch(url + "?offset=" + offset, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          var status = response.headers.get("X-Job-Status") || "";
          if (response.status === 403 || response.status === 404) {
            return "gone";
          }
          // No status header: not the log (e.g. the session expired and this is the login page).
          if (!response.ok || !status) throw new Error(response.ok ? "reload the page" : "HTTP " + response.status);
          var next = parseInt(response.headers.get("X-Log-Next-Offset") || "", 10);
          return response.arrayBuffer().then(function (body) {
            append(decoder.decode(body, { stream: true }));
            offset = isNaN(next) ? offset + body.byteLength : next;
            pre.setAttribute("data-offset", String(offset));
            return status;
          });
        })
        .then(function (status) {
          if (status === "gone") {
            say("stopped: this job is not visible to you any more; reload the page");
          } else if (ACTIVE[status]) {
            say("live: " + (LABELS[status] || status) + pollingWhy);
            window.setTimeout(tick, POLL_MS);
          } else if (!finalSeen) {
            finalSeen = true; // one last fetch for lines flushed just before the end
            say("finishing: " + (LABELS[status] || status));
            window.setTimeout(tick, 0);
          } else {
            finish(status);
          }
        })
        .catch(function (error) {
          say("reconnecting (" + error.message + ")…");
          window.setTimeout(tick, RETRY_MS);
        });
    }

    // The page's one stream (static/js/live.js) carries the log: unnamed events, ids the offsets.
    function follow(live) {
      var encoder = new TextEncoder();
      var ended = false;
      live.on("message", function (event) {
        var next = parseInt(event.lastEventId, 10);
        if (ended || isNaN(next) || next <= offset) return; // a repeat after a reconnect: had it
        // SSE takes each line's newline off; the last one is back if the offsets count it.
        var text = event.data;
        if (encoder.encode(text).length !== next - offset) text += "\n";
        append(text);
        offset = next;
        pre.setAttribute("data-offset", String(offset));
        say("live");
      });
      live.on("ready", function () {
        if (!ended) say("live");
      });
      live.on("end", function () {
        if (ended) return; // said again after a reconnect
        ended = true;
        finalSeen = true; // the job has ended: one fetch brings its status and any last byte
        say("finishing");
        tick();
      });
      live.onFallback(function (why) {
        if (ended) return;
        ended = true;
        pollingWhy = " · polling once a second: " + why;
        say("polling once a second: " + why);
        tick();
      });
    }

    var live = window.portalLive;
    if (pre.hasAttribute("data-page-stream") && live && live.streams && window.TextEncoder) {
      follow(live);
    } else {
      pollingWhy = live && !live.streams ? " · polling once a second: this browser has no EventSource" : "";
      tick();
    }
  }

  function init() {
    var pre = document.getElementById("job-log");
    if (pre && pre.getAttribute("data-log-url")) start(pre);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
