"""API tokens stored as SHA-256 hashes (portal.models.ApiToken) instead of DRF authtoken's
plaintext keys. Every existing key is hashed into an ApiToken, so it keeps working with the
same `Authorization: Token <key>` header, and the plaintext rows are deleted.

Going back to 0007 deletes the hashed tokens and cannot bring the plaintext keys back: everyone
would have to make a new token (`gpu login`, or the profile page).
"""

import hashlib

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


def hash_authtoken_keys(apps, schema_editor):
    PlainToken = apps.get_model("authtoken", "Token")
    ApiToken = apps.get_model("portal", "ApiToken")
    # Hashed here rather than by ApiToken.hash_key: a migration must not change with the code.
    ApiToken.objects.bulk_create(
        ApiToken(
            user_id=plain.user_id,
            name="API token from before hashing",
            prefix=plain.key[:8],
            key_hash=hashlib.sha256(plain.key.encode()).hexdigest(),
            created_at=plain.created,
        )
        for plain in PlainToken.objects.iterator()
    )
    PlainToken.objects.all().delete()


class Migration(migrations.Migration):
    dependencies = [
        ("portal", "0007_queue"),
        ("authtoken", "0004_alter_tokenproxy_options"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditentry",
            name="action",
            field=models.CharField(
                choices=[
                    ("reservation.create", "Booked"),
                    ("reservation.cancel", "Cancelled"),
                    ("reservation.release", "Released early"),
                    ("reservation.extend", "Extended"),
                    ("quota.team", "Team quota changed"),
                    ("quota.member", "Member quota changed"),
                    ("team.auto_release", "Auto-release of idle bookings changed"),
                    ("watchdog.stop", "GPU watchdog stopped a process"),
                    ("api_token.create", "API token created"),
                    ("api_token.revoke", "API token revoked"),
                    ("signin.unlock", "Sign-in unlocked"),
                ],
                max_length=32,
            ),
        ),
        migrations.CreateModel(
            name="ApiToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(help_text="What it is for, e.g. 'gpu CLI on laptop'.", max_length=100)),
                (
                    "prefix",
                    models.CharField(
                        db_index=True,
                        help_text="The key's first characters: shown, and used to find it.",
                        max_length=8,
                    ),
                ),
                ("key_hash", models.CharField(max_length=64, unique=True)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now, editable=False)),
                ("expires_at", models.DateTimeField(blank=True, help_text="Empty: until revoked.", null=True)),
                ("last_used_at", models.DateTimeField(blank=True, help_text="To the minute.", null=True)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="api_tokens",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={"verbose_name": "API token", "ordering": ["-created_at", "-id"]},
        ),
        # Going back: the hashed tokens go with the table; the plaintext ones are gone for good.
        migrations.RunPython(hash_authtoken_keys, migrations.RunPython.noop),
    ]
