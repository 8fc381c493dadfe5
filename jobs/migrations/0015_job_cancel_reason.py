from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0014_job_slurm_output_offset"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="cancel_reason",
            field=models.CharField(blank=True, db_default="", default="", max_length=500),
        ),
    ]
