locals {
  gpu_nodes = merge([
    for pool, p in var.gpu_pools : {
      for i in range(p.count) : "${var.name_prefix}-${replace(pool, "_", "-")}-${i + 1}" => merge(p, { pool = pool })
    }
  ]...)

  service_nodes = { for i in range(var.service_count) : "${var.name_prefix}-svc-${i + 1}" => i }

  volume_nodes = { for name, n in local.gpu_nodes : name => n if n.model_cache.kind == "volume" }

  network_id = var.create_network ? openstack_networking_network_v2.this[0].id : var.network_id
  subnet_id  = var.create_network ? openstack_networking_subnet_v2.this[0].id : var.subnet_id
  keypair    = var.create_keypair ? openstack_compute_keypair_v2.this[0].name : var.keypair_name

  # The first Cinder volume attached to a virtio instance shows up as /dev/vdb; the attach
  # resource's own `device` is only a hint most hypervisors ignore, so it is not used here.
  model_cache_devices = {
    for pool, p in var.gpu_pools : pool => p.model_cache.kind == "volume" ? ["/dev/vdb"] : p.model_cache.local_devices
  }
}

resource "openstack_networking_network_v2" "this" {
  count = var.create_network ? 1 : 0

  name           = var.name_prefix
  admin_state_up = true
}

resource "openstack_networking_subnet_v2" "this" {
  count = var.create_network ? 1 : 0

  name            = var.name_prefix
  network_id      = openstack_networking_network_v2.this[0].id
  cidr            = var.subnet_cidr
  ip_version      = 4
  dns_nameservers = var.dns_nameservers
}

resource "openstack_networking_router_v2" "this" {
  count = var.create_router ? 1 : 0

  name                = var.name_prefix
  external_network_id = var.external_network_id
}

resource "openstack_networking_router_interface_v2" "this" {
  count = var.create_router ? 1 : 0

  router_id = openstack_networking_router_v2.this[0].id
  subnet_id = local.subnet_id
}

resource "openstack_networking_secgroup_v2" "this" {
  name        = var.name_prefix
  description = "Sarv nodes: all traffic between members; SSH, Grafana and the gateway from the allowed CIDRs."
}

# NCCL, Gloo, Ray, Redis Cluster bus and Prometheus scrapes use many ports between the nodes, so members
# of the group trust each other fully; nothing else gets in except the rules below.
resource "openstack_networking_secgroup_rule_v2" "intra" {
  for_each = toset(["tcp", "udp", "icmp"])

  direction         = "ingress"
  ethertype         = "IPv4"
  protocol          = each.key
  remote_group_id   = openstack_networking_secgroup_v2.this.id
  security_group_id = openstack_networking_secgroup_v2.this.id
}

resource "openstack_networking_secgroup_rule_v2" "admin" {
  for_each = { for pair in setproduct(var.admin_allowed_cidrs, [22, 3000]) : "${pair[0]}:${pair[1]}" => pair }

  direction         = "ingress"
  ethertype         = "IPv4"
  protocol          = "tcp"
  port_range_min    = each.value[1]
  port_range_max    = each.value[1]
  remote_ip_prefix  = each.value[0]
  security_group_id = openstack_networking_secgroup_v2.this.id
}

resource "openstack_networking_secgroup_rule_v2" "api" {
  for_each = toset(var.api_allowed_cidrs)

  direction         = "ingress"
  ethertype         = "IPv4"
  protocol          = "tcp"
  port_range_min    = var.gateway_port
  port_range_max    = var.gateway_port
  remote_ip_prefix  = each.key
  security_group_id = openstack_networking_secgroup_v2.this.id
}

resource "openstack_compute_keypair_v2" "this" {
  count = var.create_keypair ? 1 : 0

  name       = var.name_prefix
  public_key = var.public_key
}

resource "openstack_networking_port_v2" "gpu" {
  for_each = local.gpu_nodes

  name               = each.key
  network_id         = local.network_id
  security_group_ids = [openstack_networking_secgroup_v2.this.id]

  fixed_ip {
    subnet_id = local.subnet_id
  }
}

resource "openstack_networking_port_v2" "service" {
  for_each = local.service_nodes

  name               = each.key
  network_id         = local.network_id
  security_group_ids = [openstack_networking_secgroup_v2.this.id]

  fixed_ip {
    subnet_id = local.subnet_id
  }
}

resource "openstack_compute_instance_v2" "gpu" {
  for_each = local.gpu_nodes

  name              = each.key
  flavor_name       = each.value.flavor_name
  image_id          = each.value.root_volume_size_gb == null ? var.image_id : null
  key_pair          = local.keypair
  availability_zone = each.value.availability_zone
  metadata          = merge(var.metadata, { sarv_role = "gpu", sarv_pool = each.value.pool })

  dynamic "block_device" {
    for_each = each.value.root_volume_size_gb == null ? [] : [each.value.root_volume_size_gb]
    content {
      uuid                  = var.image_id
      source_type           = "image"
      destination_type      = "volume"
      volume_size           = block_device.value
      boot_index            = 0
      delete_on_termination = true
    }
  }

  network {
    port = openstack_networking_port_v2.gpu[each.key].id
  }
}

resource "openstack_compute_instance_v2" "service" {
  for_each = local.service_nodes

  name        = each.key
  flavor_name = var.service_flavor_name
  image_id    = var.image_id
  key_pair    = local.keypair
  metadata    = merge(var.metadata, { sarv_role = "service" })

  network {
    port = openstack_networking_port_v2.service[each.key].id
  }
}

resource "openstack_blockstorage_volume_v3" "model_cache" {
  for_each = local.volume_nodes

  name              = "${each.key}-model-cache"
  size              = each.value.model_cache.volume_size_gb
  volume_type       = each.value.model_cache.volume_type
  availability_zone = each.value.availability_zone
  description       = "Sarv model cache (weights) of ${each.key}"
}

resource "openstack_compute_volume_attach_v2" "model_cache" {
  for_each = local.volume_nodes

  instance_id = openstack_compute_instance_v2.gpu[each.key].id
  volume_id   = openstack_blockstorage_volume_v3.model_cache[each.key].id
}

resource "openstack_networking_floatingip_v2" "service" {
  for_each = var.enable_floating_ips ? local.service_nodes : {}

  pool        = var.floating_ip_pool
  description = "Sarv ${each.key}"
}

resource "openstack_networking_floatingip_associate_v2" "service" {
  for_each = var.enable_floating_ips ? local.service_nodes : {}

  floating_ip = openstack_networking_floatingip_v2.service[each.key].address
  port_id     = openstack_networking_port_v2.service[each.key].id

  # Associating before the router interface exists fails with "external network not reachable".
  depends_on = [openstack_networking_router_interface_v2.this]
}

# The inventory is rendered by the static module, so both modules produce exactly the same layout.
module "inventory" {
  source = "../static"

  ansible_user   = var.ansible_user
  gpu_nodes_vars = var.gpu_nodes_vars

  gpu_groups = {
    for pool, p in var.gpu_pools : pool => {
      gpu_model            = p.gpu_model
      gpu_count            = p.gpu_count
      gpu_memory_mib       = p.gpu_memory_mib
      gpu_interconnect     = p.gpu_interconnect
      gpus_per_pcie_switch = p.gpus_per_pcie_switch
      numa_nodes           = p.numa_nodes
      nic                  = p.nic
      labels               = p.labels
      extra_vars           = { nvme_raid_devices = jsonencode(local.model_cache_devices[pool]) }
    } if p.count > 0
  }

  hosts = concat(
    [for name, n in local.gpu_nodes : {
      name      = name
      address   = openstack_networking_port_v2.gpu[name].all_fixed_ips[0]
      gpu_group = n.pool
    }],
    [for name, i in local.service_nodes : {
      name = name
      address = (var.inventory_address == "floating"
        ? openstack_networking_floatingip_v2.service[name].address
      : openstack_networking_port_v2.service[name].all_fixed_ips[0])
      roles = i == 0 ? ["redis", "monitoring", "controlplane"] : ["redis"]
    }],
  )
}
