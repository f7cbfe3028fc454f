terraform {
  required_version = ">= 1.9"

  required_providers {
    # Credentials never appear in this module: the provider reads OS_CLOUD / clouds.yaml or the OS_*
    # environment variables, so nothing secret lands in variables, plans, argv or state inputs.
    openstack = {
      source  = "terraform-provider-openstack/openstack"
      version = ">= 3.0, < 4.0"
    }
  }
}
