// The live log viewer of a job page: <pre id="job-log" data-log-url=… data-page-stream
// data-offset="0">.
//
// The page's one event stream (static/js/live.js; GET /jobs/<id>/events/?encoding=json,
// docs/live.md) brings the log as the job prints it: an event's data is one JSON string of its
// exact text (carriage returns included; a line still being drawn comes as it is drawn, and the
// next event goes on with it), its id the byte offset after it, and a reconnect resumes after
// the last one. At `end` one fetch of the log's endpoint
// brings the final status and any last byte; when the page gives the stream up (refused, or
// failing) the polling below takes over from the same offset, saying so.
//
// Polls `logUrl?offset=N` once a second while the job is active (X-Job-Status queued,
// starting or running), appends the new bytes as text (never as HTML: the log is
// whatever the script printed), and continues at X-Log-Next-Offset. When the status is
// final it fetches once more (lines written between the last poll and the end), then
// stops and sets data-done="1" on the <pre>. No libraries.
//
// The text is shown as a terminal shows it, line by line: a carriage return goes back to the
// line's start (after the worker's timestamp) and what follows writes over it, a backspace steps
// back, erasing and moving along the line are done, and colour codes are left out. A Keras or
// tqdm progress bar is then one bar, redrawn in place (the worker stores a line still being drawn
// every half second without a newline, and goes on with it), not one line per redraw with its
// escape codes; the download keeps the bytes as printed.
(function () {
  "use strict";

  var ACTIVE = { queued: true, starting: true, running: true };
  var POLL_MS = 1000;
  var RETRY_MS = 3000;
  // ESC sequences other than CSI (a title's OSC, which ends at the line's end at the latest; a
  // charset's), and a lone ESC: left out. CSI ones (ESC [ …) are `write`'s: a colour is left out,
  // erasing and moving along the line are done. One that a read cut off at the end of the text
  // waits for the rest, at most CUT_MAX characters of it.
  var OTHER_CODES = /\x1b(?:\][^\x07\x1b\n]*(?:\x07|\x1b\\)?|(?!\[)[ -\/]*[0-~]|(?!\[))/g;
  var CUT_CODE = /\x1b(?:\[[0-?]*[ -\/]*|\][^\x07\x1b\n]*|[ -\/]*)$/;
  var CUT_MAX = 256;
  var CONTROLS = /(\r|\n|\x08|\x1b\[[0-?]*[ -\/]*[@-~])/;
  var STAMP = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z /;
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

    // The line being written (after the last newline) as shown, where the next character goes,
    // its text node, and an ESC sequence waiting for the rest of it.
    var line = "";
    var column = 0;
    var lineNode = null;
    var cut = "";

    function lineStart() {
      var stamp = STAMP.exec(line);
      return stamp ? stamp[0].length : 0;
    }

    function blanks(count) {
      return count > 0 ? new Array(count + 1).join(" ") : "";
    }

    // A CSI sequence within the line: erase in it (K), move back (D), on (C) or to a column (G);
    // any other (a colour) shows nothing. The worker's timestamp is never erased. Columns count
    // UTF-16 units, not a terminal's cells (a wide or astral character is off by one).
    function csi(code) {
      var start = lineStart();
      var n = parseInt(code.slice(2, -1), 10);
      var kind = code.charAt(code.length - 1);
      var at = Math.max(column, start);
      if (kind === "K" && !(n > 0)) line = line.slice(0, at);
      else if (kind === "K" && n === 1) line = line.slice(0, start) + blanks(at + 1 - start) + line.slice(at + 1);
      else if (kind === "K" && n === 2) line = line.slice(0, start);
      else if (kind === "D") column = Math.max(start, column - (n || 1));
      else if (kind === "C") column += n || 1;
      else if (kind === "G") column = start + Math.max(n || 1, 1) - 1;
    }

    // `text` as a terminal writes it; returns the lines it finished, each with its newline.
    function write(text) {
      var finished = "";
      var parts = text.split(CONTROLS);
      for (var i = 0; i < parts.length; i++) {
        var part = parts[i];
        if (part === "\n") {
          finished += line + "\n";
          line = "";
          column = 0;
        } else if (part === "\r") {
          column = lineStart();
        } else if (part === "\x08") {
          column = Math.max(lineStart(), column - 1);
        } else if (part.charAt(0) === "\x1b") {
          csi(part);
        } else if (part) {
          if (column > line.length) line += blanks(column - line.length);
          line = line.slice(0, column) + part + line.slice(column + part.length);
          column += part.length;
        }
      }
      return finished;
    }

    function append(text) {
      text = cut + (text || "");
      var held = CUT_CODE.exec(text);
      if (held && held[0].length > CUT_MAX) held = null; // not a code after all: shown
      cut = held ? held[0] : "";
      if (held) text = text.slice(0, held.index);
      if (!text) return;
      var follow = atBottom();
      // Text nodes, so no markup is parsed; the lines finished here go in one node, and only the
      // unfinished line's node is rewritten as a bar redraws it.
      var finished = write(text.replace(OTHER_CODES, ""));
      if (finished) {
        if (lineNode) lineNode.data = finished;
        else pre.appendChild(document.createTextNode(finished));
        lineNode = null;
      }
      if (line && !lineNode) lineNode = pre.appendChild(document.createTextNode(line));
      else if (lineNode) lineNode.data = line;
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

    // An event's text: the JSON string the page asked for (?encoding=json). A portal that sent
    // plain lines instead lost its carriage returns, and its last newline is guessed from the
    // offsets.
    function exactText(data, bytes) {
      if (data.charAt(0) === '"') {
        try {
          return JSON.parse(data);
        } catch (error) {
          // not JSON after all: plain lines
        }
      }
      return new TextEncoder().encode(data).length === bytes ? data : data + "\n";
    }

    // The page's one stream (static/js/live.js) carries the log: unnamed events, ids the offsets.
    function follow(live) {
      var ended = false;
      live.on("message", function (event) {
        var next = parseInt(event.lastEventId, 10);
        if (ended || isNaN(next) || next <= offset) return; // a repeat after a reconnect: had it
        append(exactText(event.data, next - offset));
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
