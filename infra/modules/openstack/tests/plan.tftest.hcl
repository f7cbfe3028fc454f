# Needs the openstack provider installed (terraform init from a registry or a provider mirror):
# `terraform test` loads the provider's schema even for mock_provider, so this cannot run fully offline.
mock_provider "openstack" {
  mock_resource "openstack_networking_port_v2" {
    defaults = {
      all_fixed_ips = ["10.20.0.50"]
    }
  }
  mock_resource "openstack_networking_floatingip_v2" {
    defaults = {
      address = "192.0.2.10"
    }
  }
}

variables {
  name_prefix         = "sarv-test"
  image_id            = "00000000-0000-0000-0000-000000000000"
  keypair_name        = "ops"
  service_flavor_name = "m1.large"
  gpu_pools = {
    h100 = { flavor_name = "gpu.h100", count = 2, gpu_model = "H100-SXM5-80GB", gpu_count = 8, gpu_memory_mib = 81559 }
    l40s = { flavor_name = "gpu.l40s", count = 1, gpu_model = "L40S", gpu_count = 2, gpu_memory_mib = 46068, model_cache = { kind = "volume" } }
  }
}

run "plans_nodes_volumes_and_inventory" {
  command = apply

  assert {
    condition     = length(openstack_compute_instance_v2.gpu) == 3 && length(openstack_compute_instance_v2.service) == 3
    error_message = "expected 3 GPU and 3 service instances"
  }
  assert {
    condition     = jsonencode(keys(openstack_blockstorage_volume_v3.model_cache)) == jsonencode(["sarv-test-l40s-1"])
    error_message = "only volume-backed pools get a Cinder volume"
  }
  assert {
    condition     = strcontains(output.inventory, "[gpu_nodes:children]\nh100\nl40s\n")
    error_message = "inventory must list one child group per pool"
  }
  assert {
    condition     = length(openstack_networking_floatingip_v2.service) == 0
    error_message = "no floating IPs unless enable_floating_ips"
  }
}

run "refuses_ssh_from_everywhere" {
  command = plan
  variables {
    admin_allowed_cidrs = ["0.0.0.0/0"]
  }
  expect_failures = [var.admin_allowed_cidrs]
}
