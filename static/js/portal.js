/* What every page needs from script, in a file: the pages' Content-Security-Policy runs no
 * inline script and no inline handler (settings.CONTENT_SECURITY_POLICY), so markup asks for
 * behaviour with data attributes and this file gives it, by delegation (parts htmx swaps in later
 * work too):
 * - the browser's time zone, for the next request, where the person chose none
 *   (encodeURIComponent here, decoded by portal/time_zones.py's browser_zone: the pair must match);
 * - <form data-confirm="question">: asks before it is sent;
 * - <input data-select-on-focus>: selects its text when focused (addresses to copy);
 * - <button data-fill="#input" data-value="8G">: puts the value in that input and focuses it;
 * - an htmx part marked data-script-name (the job form's size hint) asks with script=<the chosen
 *   upload's file name, else the path typed> (htmx's hx-vals="js:…" would need eval);
 * - every <form method="post"> is sent once: a second submit while the first is on its way (a
 *   double click, Enter pressed twice) would book a second set of cards or queue the job twice.
 */
(function () {
  "use strict";
  try {
    const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
    const cookie = "browser_tz=" + encodeURIComponent(zone);
    if (zone && document.cookie.indexOf(cookie) < 0) {
      document.cookie = cookie + "; path=/; max-age=31536000; SameSite=Lax";
    }
  } catch (e) {
    // No Intl time zone (an old browser): the portal's own zone is shown, and said so.
  }

  document.addEventListener("submit", function (event) {
    const form = event.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
  });

  // After the confirm's listener: a submit it stopped was never sent. Not its buttons disabled: a
  // disabled button's name and value would not be sent with the form. Sent again after a while
  // all the same, where no page came (a download, a connection that hung): the person decides.
  const SEND_AGAIN_AFTER_MS = 15000;
  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (event.defaultPrevented || !form || form.method !== "post") return;
    const sentAt = Number(form.dataset.sentAt || 0);
    if (sentAt && Date.now() - sentAt < SEND_AGAIN_AFTER_MS) {
      event.preventDefault();
      return;
    }
    form.dataset.sentAt = String(Date.now());
    form.setAttribute("aria-busy", "true");
  });

  // Back to a page the browser kept (its back-forward cache): its forms may be sent anew.
  window.addEventListener("pageshow", function (event) {
    if (!event.persisted) return;
    document.querySelectorAll("form[data-sent-at]").forEach(function (form) {
      delete form.dataset.sentAt;
      form.removeAttribute("aria-busy");
    });
  });

  document.addEventListener("focusin", function (event) {
    if (event.target.matches && event.target.matches("input[data-select-on-focus]")) event.target.select();
  });

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button[data-fill]");
    if (!button) return;
    const input = document.querySelector(button.dataset.fill);
    if (!input) return;
    input.value = button.dataset.value;
    input.focus();
  });

  document.addEventListener("htmx:configRequest", function (event) {
    if (!event.detail.elt.hasAttribute("data-script-name")) return;
    const upload = document.getElementById("id_script");
    const path = document.getElementById("id_script_path");
    const chosen = upload && upload.files && upload.files.length ? upload.files[0].name : "";
    event.detail.parameters.script = chosen || (path ? path.value : "");
  });
})();
