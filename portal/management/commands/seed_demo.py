from django.conf import settings
from django.core.management.base import BaseCommand

from portal.services import demo_data_seed


class Command(BaseCommand):
    help = "On an empty database, create the demo team (leader, alice, bob) and the admin user."

    def handle(self, *args, **options) -> None:
        if demo_data_seed(password=settings.PORTAL_DEMO_PASSWORD):
            self.stdout.write("Seeded demo users: admin, leader, alice, bob.")
        else:
            self.stdout.write("Users exist already; demo data not seeded.")
