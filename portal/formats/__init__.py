"""The portal's date and time formats (FORMAT_MODULE_PATH), for what Django formats on its own:
Django's admin lists and read-only fields, and a template's `{{ a_datetime }}` without a
`|date:` format. The same 24-hour, year-first shapes as portal.timefmt, so /admin/ and the
portal's pages write a time one way."""
