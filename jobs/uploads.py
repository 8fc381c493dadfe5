"""An upload handler that keeps at most JOB_UPLOAD_MAX_KB + 1 bytes of any file.

Django would otherwise spool a whole upload to a temporary file before the job service
can refuse it: a 10 GB "script" would fill the disk. This handler reads the rest of the
request and throws it away, keeping the true size for the service's message.
"""

from __future__ import annotations

from io import BytesIO

from django.conf import settings
from django.core.files.uploadedfile import InMemoryUploadedFile
from django.core.files.uploadhandler import FileUploadHandler


class CappedUploadHandler(FileUploadHandler):
    def new_file(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().new_file(*args, **kwargs)
        self.kept = BytesIO()
        self.size = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        room = settings.JOB_UPLOAD_MAX_KB * 1024 + 1 - self.kept.tell()
        if room > 0:
            self.kept.write(raw_data[:room])
        self.size += len(raw_data)
        return None  # handled here: no later handler gets the data

    def file_complete(self, file_size: int) -> InMemoryUploadedFile:
        self.kept.seek(0)
        return InMemoryUploadedFile(
            file=self.kept,
            field_name=self.field_name,
            name=self.file_name,
            content_type=self.content_type,
            size=self.size,  # the true size, for "the script is N KB" messages
            charset=self.charset,
            content_type_extra=self.content_type_extra,
        )
