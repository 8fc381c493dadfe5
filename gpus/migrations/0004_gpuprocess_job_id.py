from django.db import migrations, models


class Migration(migrations.Migration):
    """GPUProcess.job becomes a plain job id: gpus no longer refers to the jobs app.

    Process rows are replaced every telemetry round, so nothing is lost by re-creating the column.
    """

    dependencies = [
        ("gpus", "0003_gpuprocess_job"),
    ]

    operations = [
        migrations.RemoveField(model_name="gpuprocess", name="job"),
        migrations.AddField(
            model_name="gpuprocess",
            name="job_id",
            field=models.PositiveBigIntegerField(
                blank=True, help_text="The portal job (PORTAL_JOB_ID).", null=True
            ),
        ),
    ]
